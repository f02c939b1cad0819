"""Does stalwart cost GPU throughput? `stalwart train` vs a plain PyTorch loop and vs torchtitan's
trainer on the same model and batch, one GPU, bf16, plus what flash checkpoints cost there, in one run.

    python benchmarks/gpu_step.py [--json] [--out-json F]   # CUDA: ~280M LLaMA-style, seq 2048, ~2 min on an H100
    python benchmarks/gpu_step.py --smoke --peak-tflops 0.05  # every section on the CPU, tiny shape (~40 s)

Sections, in this order, each under ``--section-timeout`` (a failure or timeout is recorded in its
place and the next section runs; ``--out-json`` is rewritten after each, so a killed run leaves
what it measured):
- baseline: the plain loop (same ``build_model``, AdamW, grad clipping, bf16 autocast, micro-batches);
- stalwart: `stalwart train`, 1 rank, checkpoints off;
- checkpoint: a memory snapshot every step: blocking per save (the save call + the optimizer hook's
  waits) in ms and as a fraction of the median step (issue 27: ≤ 1 %);
- restore: a checkpointed run SIGKILLed (chaos) after its step 2 and restarted: restore from memory;
- torchtitan: its Trainer (benchmarks/gpu_titan.py) on the same shape/batch/steps, when importable.
Throughput is the median step (torchtitan: the mean over the timed steps) after ``--warmup``; MFU =
(6·N + attention FLOPs) per token (stalwart.plan.compute) × tokens/s / the bf16 peak (the GPU's from
stalwart.plan.hardware, or ``--peak-tflops``); ``ratios`` are stalwart's tokens/s over each baseline's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step_parts as parts

# (shape, seq_len, micro_batch, global_batch, warmup, steps) on CUDA, and for --smoke
GPU_DEFAULTS = ("280m", 2048, 8, 16, 5, 15)
SMOKE_DEFAULTS = ("tiny", 32, 2, 4, 1, 4)
SECTIONS = ("baseline", "stalwart", "checkpoint", "restore", "torchtitan")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parts.add_run_arguments(p, GPU_DEFAULTS[0], "section")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: CUDA if available")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--section-timeout", type=float, default=240.0, help="seconds per subprocess of a section")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the memory snapshots (2 × the state)")
    a = p.parse_args(argv)
    import torch

    if a.device == "auto":
        a.device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if a.device == "cpu" and not a.smoke:
        p.exit(
            2,
            "benchmarks/gpu_step.py needs CUDA (torch.cuda.is_available() is False); "
            "--smoke runs every section on the CPU with a tiny shape\n",
        )
    parts.fill_run_defaults(p, a, SMOKE_DEFAULTS if a.smoke else GPU_DEFAULTS)
    a.sections = parts.chosen(p, a.sections, SECTIONS, "sections")
    return a


def rates(step_s: float, tokens_per_step: int, fpt: float, peak: float) -> dict[str, float | None]:
    tps = tokens_per_step / step_s
    return {"step_s": step_s, "tokens_per_s": tps, "mfu": fpt * tps / peak if peak else None}


def ratios(r: dict) -> dict[str, float | None]:
    """stalwart's tokens/s over each baseline's (= the MFU ratio: same model, batch and FLOPs)."""
    s = r.get("stalwart", {}).get("tokens_per_s")

    def over(name: str) -> float | None:
        base = r.get(name, {}).get("tokens_per_s")
        return s / base if s and base else None

    return {"stalwart_vs_plain": over("baseline"), "stalwart_vs_torchtitan": over("torchtitan")}


def measure(a: argparse.Namespace, emit: Callable[[dict], None] = lambda r: None) -> dict:
    """Run the sections in order; ``emit`` gets the result so far after each one."""
    from stalwart.plan.compute import flops_per_token

    r, work, data = parts.run_header(a, "stalwart-gpu-step-")
    n_params, peak = r["model"]["n_params"], r["peak_flops"]
    fpt = r["flops_per_token"] = flops_per_token(n_params, a.shape["n_layers"], a.shape["dim"], a.seq_len)
    tokens_per_step = a.global_batch * a.seq_len
    r["sections"] = {}  # wall seconds each section took, or why it did not run

    def section(name: str, fn: Callable[[], dict], throughput: bool = False) -> None:
        if name not in a.sections:
            r["sections"][name] = "not requested"
            return
        t0 = time.perf_counter()
        try:
            out = fn()
            if throughput and "step_s" in out:
                out = {**out, **rates(out["step_s"], tokens_per_step, fpt, peak)}
        except parts.SectionError as e:
            out = {"error": str(e)}
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        r[name] = out
        r["sections"][name] = round(time.perf_counter() - t0, 1)
        r["ratios"] = ratios(r)
        emit(r)

    section("baseline", lambda: parts.plain_loop(a, data), throughput=True)
    section("stalwart", lambda: parts.stalwart_plain(a, data, work), throughput=True)
    plain_step = r.get("stalwart", {}).get("step_s")
    section("checkpoint", lambda: parts.snapshot_every_step(a, data, work, plain_step))
    section("restore", lambda: parts.restore_after_kill(a, data, work))
    section("torchtitan", lambda: parts.torchtitan(a, work), throughput=True)
    t = r.get("torchtitan", {})
    if "n_params" in t and t["n_params"] != n_params:
        t["shape_mismatch"] = f"torchtitan's model has {t['n_params']} parameters, stalwart's {n_params}"
    return r


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report(r: dict) -> None:
    print(f"{r['device']}, {r['model']['n_params'] / 1e6:,.2f} M params, seq {r['seq_len']}, batch {r['global_batch']}")
    for key in ("baseline", "stalwart", "torchtitan"):
        x = r.get(key, {})
        if "tokens_per_s" in x:
            print(f"{key:<11} {x['tokens_per_s']:>12,.0f} tok/s  MFU {fmt(x['mfu'], '.1%')}  ({x.get('name', key)})")
        else:
            print(f"{key:<11} {x.get('skipped') or x.get('error') or r['sections'].get(key)}")
    rt = r.get("ratios", {})
    print(f"stalwart / plain loop {fmt(rt.get('stalwart_vs_plain'), '.3f')}, ", end="")
    print(f"/ torchtitan {fmt(rt.get('stalwart_vs_torchtitan'), '.3f')}")
    c = r.get("checkpoint", {})
    if "blocking_ms_per_save" in c:
        print(
            f"snapshot every step: {c['blocking_ms_per_save']:.2f} ms blocking per save "
            f"= {c['blocking_fraction']:.2%} of a {c['step_s'] * 1e3:.0f} ms step (target ≤ 1 %)"
        )
    else:
        print(f"checkpoint: {c.get('skipped') or c.get('error') or r['sections'].get('checkpoint')}")
    x = r.get("restore", {})
    if "restore_s" in x:
        print(f"restore from {x['restored_from']} (step {x['restore_step']}): {x['restore_s']:.2f} s")
    else:
        print(f"restore: {x.get('skipped') or x.get('error') or r['sections'].get('restore')}")


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    r = measure(a, parts.writer(a.out_json))
    if a.json:
        print(json.dumps(r, indent=1, default=str))
    else:
        report(r)


if __name__ == "__main__":
    main()
