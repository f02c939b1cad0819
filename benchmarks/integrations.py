"""Work a restart redoes with a framework's own checkpoints vs with stalwart's memory snapshots.

    python benchmarks/integrations.py [--json] [--repeats 1] [--steps 12] [--kill-step 9] [--save-every 5]

Each framework's job (tests/e2e/scripts/{hf,lightning,fabric}_train.py: a tiny model, 2 ranks, DDP over
gloo on the CPU) runs under ``stalwart run --max-restarts 2`` with rank 1 SIGKILLed after ``--kill-step``
(``--chaos kill:rank=1:step=K``), twice: ``native``, the framework's own checkpoints every
``--save-every`` steps (Trainer ``save_steps``; Lightning ``ModelCheckpoint(every_n_train_steps)``;
Fabric ``fabric.save`` to a file) and its own resume from the newest; ``stalwart``, the integration's
memory snapshot after every step (``every_steps=1``). Both restarts go through the same agent; only the
checkpoint differs.

``steps_redone`` = steps completed before the kill and again after the restart (rank 0's log of
completed steps, not what the job reports about itself); ``resumed_from`` = the step the restart began
after; ``wall_s`` = the whole faulty job (launcher start → exit); ``bitwise_as_fault_free`` = the final
weights and optimizer state equal those of a fault-free run (one more run per framework): Lightning's
and Fabric's own resume keep no RNG, so dropout after the restart differs (and a plain ``fabric.load``
does not restore Fabric's pass counter, which sets the ``DistributedSampler``'s epoch). Medians over
``--repeats``; each run's values under ``runs``. 20-45 s per run on 2 shared cores, ~4 min in all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {fw: ROOT / f"tests/e2e/scripts/{fw}_train.py" for fw in ("hf", "lightning", "fabric")}


def run(framework: str, mode: str, every: int, steps: int, kill: int | None, work: Path) -> dict:
    out = work / "out"
    out.mkdir(parents=True)
    cmd = [
        *(sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", "2", "--run-dir", str(work / "run")),
        *(("--chaos", f"kill:rank=1:step={kill}") if kill else ()),
        *(str(SCRIPTS[framework]), "--out", str(out), "--ckpt", str(work / "ckpt")),
        *(f"--steps={steps}", f"--every={every}", f"--mode={mode}"),
    ]
    env = {**os.environ, "STALWART_CHAOS_DIR": str(work / "chaos"), "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{framework}/{mode} failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    before = {s["step"] for s in lines if s["attempt"] == 0}
    after = [s["step"] for s in lines if s["attempt"] > 0]
    result = json.loads((out / "result.json").read_text())
    return {
        "steps_redone": sum(1 for s in after if s in before),
        "resumed_from": min(after) - 1 if after else None,
        "wall_s": round(wall, 2),
        "final": result["weights"] + result["optim"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=9)
    parser.add_argument("--save-every", type=int, default=5, help="the framework's own checkpoint interval")
    parser.add_argument("--frameworks", default="hf,lightning,fabric")
    args = parser.parse_args()
    if not 0 < args.kill_step < args.steps:
        raise SystemExit(f"--kill-step must be within 1..{args.steps - 1}")
    report: dict = {
        "config": {k: getattr(args, k) for k in ("steps", "kill_step", "save_every", "repeats")} | {"ranks": 2},
        "frameworks": {},
    }
    for fw in args.frameworks.split(","):
        modes = {"native": ("native", args.save_every), "stalwart": ("stalwart", 1)}
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for name, (mode, every) in modes.items():
                with tempfile.TemporaryDirectory(prefix=f"bench-{fw}-{name}-") as tmp:
                    runs[name].append(run(fw, mode, every, args.steps, args.kill_step, Path(tmp)))
                    if not args.json:
                        print(f"{fw:9s} {name:8s} {runs[name][-1]}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix=f"bench-{fw}-reference-") as tmp:
            reference = run(fw, "stalwart", 1, args.steps, None, Path(tmp))["final"]
        entry: dict = {}
        for name, rs in runs.items():
            entry[name] = {
                "bitwise_as_fault_free": all(r["final"] == reference for r in rs),
                "checkpoint_every_steps": modes[name][1],
                "steps_redone": statistics.median(r["steps_redone"] for r in rs),
                "resumed_from": statistics.median(r["resumed_from"] for r in rs),
                "wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
                "runs": [{k: v for k, v in r.items() if k != "final"} for r in rs],
            }
        report["frameworks"][fw] = entry
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for fw, e in report["frameworks"].items():
            n, s = e["native"], e["stalwart"]
            print(
                f"{fw}: steps redone {n['steps_redone']} (own checkpoints every {n['checkpoint_every_steps']}) → "
                f"{s['steps_redone']} (stalwart snapshot every step); wall {n['wall_s']} s → {s['wall_s']} s; "
                f"bitwise as fault-free: {n['bitwise_as_fault_free']} → {s['bitwise_as_fault_free']}"
            )


if __name__ == "__main__":
    main()
