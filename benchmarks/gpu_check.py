"""`make gpu-check`: tests/gpu and benchmarks/gpu_step.py on a CUDA machine, then one summary with
issue 17's acceptance checks. Exit 0 only when every test passed and every target was met.

    python benchmarks/gpu_check.py [--out DIR] [--bench-args "--steps 30"]

Without CUDA it says so and exits 2 (nothing here can be checked on a CPU); docs/gpu.md has the
procedure for the lent GPU machines (what to carry, how to call).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKING_MAX, MFU_RATIO_MIN = 0.01, 0.95  # issue 17's acceptance


def tests(out: Path) -> dict:
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-s", "-rs", f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "gpu-tests.log").write_text(proc.stdout + proc.stderr)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            kind = {"failure": "failed", "error": "failed"}.get(kind, kind)
            counts[kind] += 1
            if kind == "failed":
                failed.append(case.get("name"))
    figures = [
        line.strip()
        for line in proc.stdout.splitlines()
        if line.startswith(("GPU ", "snapshot ", "stop ", "hang ", "--parallel"))
    ]
    return {"rc": proc.returncode, **counts, "failed_tests": failed, "figures": figures}


def bench(out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "benchmarks/gpu_step.py", "--json", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "gpu-step.log").write_text(proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip()[-2000:]}
    result = json.loads(proc.stdout)
    (out / "gpu-step.json").write_text(json.dumps(result, indent=1))
    return result


def verdicts(t: dict, b: dict) -> list[tuple[str, bool, str]]:
    rows = [("tests/gpu green", t["rc"] == 0 and t["passed"] > 0, f"{t['passed']} passed, {t['failed']} failed")]
    if "error" in b:
        return [*rows, ("benchmark ran", False, b["error"].splitlines()[-1])]
    s, base, c = b["stalwart"], b["baseline"], b["checkpoint"]
    if s["mfu"] is not None and base["mfu"]:
        ratio = s["mfu"] / base["mfu"]
        rows.append(
            (f"MFU ≥ {MFU_RATIO_MIN} × baseline", ratio >= MFU_RATIO_MIN, f"{s['mfu']:.1%} vs {base['mfu']:.1%}")
        )
    else:
        ratio = b["throughput_ratio"]
        rows.append((f"tokens/s ≥ {MFU_RATIO_MIN} × baseline", ratio >= MFU_RATIO_MIN, f"{ratio:.3f} (peak unknown)"))
    if "skipped" in c:
        rows.append(("snapshot blocking ≤ 1 %", False, f"skipped: {c['skipped']}"))
    else:
        frac = c["blocking_fraction"]
        rows.append(("snapshot blocking ≤ 1 % of a step", frac <= BLOCKING_MAX, f"{frac:.2%}"))
        rows.append(("restore from memory", c["restored_from"] == "memory", f"{c['restore_s']:.2f} s"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu-check", help="logs, junit XML and the benchmark's JSON")
    p.add_argument("--bench-args", default="", help="extra arguments for benchmarks/gpu_step.py")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check needs CUDA: torch {torch.__version__} sees no GPU; see docs/gpu.md", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = tests(out)
    b = bench(out, shlex.split(a.bench_args))
    rows = verdicts(t, b)
    print(f"== gpu-check on {torch.cuda.get_device_name()}, torch {torch.__version__} ==")
    for what, ok, detail in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {detail}")
    for line in t["figures"]:
        print(f"      {line}")
    for name in t["failed_tests"]:
        print(f"      failed: {name}")
    if "error" not in b:
        s, base = b["stalwart"], b["baseline"]
        print(f"      tokens/s stalwart {s['tokens_per_s']:,.0f} vs plain loop {base['tokens_per_s']:,.0f}")
    print(f"logs in {out}/")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
