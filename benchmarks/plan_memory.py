"""Claim: `stalwart plan`'s memory estimator predicts the real trainer's peak memory within 20 %.

For each configuration, a fresh subprocess builds the real ``Trainer`` (world of one, DDP over gloo,
fp32 on CPU) and runs a few optimizer steps, so that Adam state exists and gradients are held across
gradient-accumulation micro-batches — the steady-state peak. Two measurements:

* ``measured_mb`` (the one compared): the peak of live tensor bytes, reconstructed from the CPU
  allocator's own events (torch.profiler with ``profile_memory=True``: every allocation and free,
  replayed in time order). Profiling starts before the Trainer is built, so weights, gradients, DDP
  buckets, optimizer state, activations and temporaries are all seen. This is the CPU analogue of
  ``torch.cuda.max_memory_allocated`` — what the estimator predicts.
* ``rss_growth_mb`` (cross-check, separate run without the profiler): peak resident set size minus
  the RSS just before the Trainer is built. It also counts allocator slack, the memory-mapped token
  file and Python objects, so it is expected to exceed the tensor peak somewhat.

The prediction uses the same planner code as `stalwart plan`, told how this trainer stores things
(fp32 weights/grads, no master copy, Adam 8 B/param, DDP's separate gradient buckets, foreach AdamW's
one temporary per parameter, the CPU flash-attention kernel, PyTorch's unfused RMSNorm).

    python benchmarks/plan_memory.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "prepared" / "stdlib-byte"

# name -> (model, seq_len, global_batch, micro_batch, steps): accumulation of 2 in every case
CONFIGS = {
    "debug": ("debug", 128, 8, 4, 2),  # activation-dominated
    "small": ("small", 128, 8, 4, 2),  # activations on top of a larger model state
    "small-mb1": ("small", 128, 2, 1, 2),  # peak in the optimizer step (state + Adam temporaries)
}


# -- the measuring worker (runs in a fresh process) ----------------------------------------------
def _worker(model: str, seq: int, gb: int, mb: int, steps: int, mode: str, out_dir: str) -> dict:
    import resource

    import psutil
    import torch  # noqa: F401  (imported before the baseline is taken)

    from stalwart.config import load_config
    from stalwart.data import ensure_default_corpus
    from stalwart.dist import init_distributed, shutdown
    from stalwart.train.trainer import Trainer

    ensure_default_corpus(DATA)
    cfg = load_config(
        None,
        {
            "model.name": model,
            "data.seq_len": seq,
            "data.dir": str(DATA),
            "data.prepare_default": False,
            "train.global_batch": gb,
            "train.micro_batch": mb,
            "train.steps": steps,
            "train.warmup_steps": 0,
            "train.out_dir": out_dir,
        },
    )
    env = init_distributed("gloo")
    result: dict = {}
    if mode == "trace":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer = Trainer(cfg, env)
            for _ in range(steps):
                trainer.train_step()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:
            live += e.nbytes()
            peak = max(peak, live)
        result.update(peak_bytes=peak, events=len(events))
    else:
        before = psutil.Process().memory_info().rss
        trainer = Trainer(cfg, env)
        for _ in range(steps):
            trainer.train_step()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        result.update(rss_growth_bytes=peak_rss - before)
    a = trainer.model_args
    result.update(
        n_params=trainer.n_params,
        accum=trainer.accum,
        args=dict(
            dim=a.dim,
            n_layers=a.n_layers,
            n_heads=a.n_heads,
            n_kv_heads=a.kv_heads,
            vocab_size=a.vocab_size,
            ffn_hidden=a.hidden,
            max_seq_len=a.max_seq_len,
        ),
    )
    shutdown()
    return result


def _run_worker(name: str, mode: str, tmp: Path) -> dict:
    model, seq, gb, mb, steps = CONFIGS[name]
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        model,
        str(seq),
        str(gb),
        str(mb),
        str(steps),
        mode,
        str(tmp / f"{name}-{mode}"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"worker {name}/{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- prediction ----------------------------------------------------------------------------------
def predict(name: str, args: dict) -> dict:
    """The planner's estimate for the trainer's configuration ``name``."""
    from stalwart.models import ModelArgs
    from stalwart.plan.memory import ActivationOptions, MemoryOptions, Precision, memory_per_gpu
    from stalwart.plan.parallel import Strategy
    from stalwart.plan.shape import ModelShape

    _, seq, gb, mb, _ = CONFIGS[name]
    shape = ModelShape.from_args(ModelArgs(**args), name=name)
    trainer_profile = MemoryOptions(
        precision=Precision(
            weight_bytes=4,
            grad_bytes=4,
            master_bytes=0,
            optimizer_bytes=8,
            activation_bytes=4,
            grad_buffer_bytes=4,
            optimizer_temp_bytes=4,
        ),
        activations=ActivationOptions(sequence_parallel=False, flash_attention=True, dropout=False, fused_norm=False),
        headroom=0.0,
    )
    bd = memory_per_gpu(shape, Strategy(micro_batch=mb, zero=0, recompute="none"), seq, gb, trainer_profile)
    return {
        "predicted_bytes": bd.total,
        "shape_params": shape.total_params(),
        "breakdown_mb": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in bd.gb().items()},
    }


def measure(names: list[str], rss: bool = True) -> dict:
    import tempfile

    rows = {}
    with tempfile.TemporaryDirectory(prefix="plan_memory_") as tmp:
        for name in names:
            t0 = time.perf_counter()
            trace = _run_worker(name, "trace", Path(tmp))
            pred = predict(name, trace["args"])
            if pred["shape_params"] != trace["n_params"]:
                raise RuntimeError(f"{name}: planner counts {pred['shape_params']} params, trainer {trace['n_params']}")
            row = {
                "config": dict(zip(("model", "seq_len", "global_batch", "micro_batch", "steps"), CONFIGS[name])),
                "grad_accum": trace["accum"],
                "n_params": trace["n_params"],
                "predicted_mb": pred["predicted_bytes"] / 1e6,
                "measured_mb": trace["peak_bytes"] / 1e6,
                "ratio": pred["predicted_bytes"] / trace["peak_bytes"],
                "predicted_breakdown_mb": pred["breakdown_mb"],
                "allocator_events": trace["events"],
            }
            if rss:
                row["rss_growth_mb"] = _run_worker(name, "rss", Path(tmp))["rss_growth_bytes"] / 1e6
                row["ratio_vs_rss"] = row["predicted_mb"] / row["rss_growth_mb"]
            row["seconds"] = time.perf_counter() - t0
            rows[name] = row
    worst = max(abs(r["ratio"] - 1) for r in rows.values())
    return {
        "benchmark": "plan_memory",
        "metric": "peak live tensor bytes (CPU allocator trace)",
        "models": rows,
        "max_abs_error": worst,
        "within_20pct": worst <= 0.20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated from {', '.join(CONFIGS)}")
    ap.add_argument("--no-rss", action="store_true", help="skip the RSS cross-check runs")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        model, seq, gb, mb, steps, mode, out = args.worker
        print(json.dumps(_worker(model, int(seq), int(gb), int(mb), int(steps), mode, out)))
        return 0
    names = [n for n in args.configs.split(",") if n]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    result = measure(names, rss=not args.no_rss)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plan memory estimate vs the real trainer (CPU, fp32, DDP world of one)")
    for col in ("config", "params", "predicted MB", "measured MB", "ratio", "RSS growth MB"):
        table.add_column(col, justify="right")
    for name, r in result["models"].items():
        table.add_row(
            name,
            f"{r['n_params']:,}",
            f"{r['predicted_mb']:.1f}",
            f"{r['measured_mb']:.1f}",
            f"{r['ratio']:.3f}",
            f"{r.get('rss_growth_mb', float('nan')):.1f}",
        )
    Console().print(table)
    print(f"max |ratio - 1| = {result['max_abs_error']:.3f}; within 20 %: {result['within_20pct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
