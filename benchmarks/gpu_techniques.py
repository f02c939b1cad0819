"""What each training technique of issue 28 does to throughput on one GPU: `stalwart train` on a ~1B
LLaMA-style model (Llama-3.2-1B blocks, seq 2048, bf16) with each technique on, against the same run
with none, in one process tree and ≤ 8 minutes (a GPU loan is 15):

    python benchmarks/gpu_techniques.py [--json] [--out-json F]        # CUDA
    python benchmarks/gpu_techniques.py --smoke --peak-tflops 0.05     # every line on the CPU, tiny shape

Variants, in this order (each a `stalwart train` run; ``--variants`` picks a subset):
- off: the defaults (data prefetch 2 on, eager blocks, sequential block, full causal attention);
- compile: ``train.compile=true`` (each block through torch.compile: fused norm and activation);
- parallel_block: ``model.parallel_block=true`` (MegaScale's attention and MLP from one norm);
- attn_window: ``model.attn_window=seq/4`` (sliding-window attention: fewer FLOPs per token);
- prefetch_off: ``data.prefetch=0`` (the batch read inside the step: what prefetch hides).
Each: the median logged step after ``--warmup``; tokens/s; MFU with the variant's own FLOPs per token
(stalwart.plan.compute: the window counts); ``vs_off`` = its tokens/s over off's. A variant that
would start after ``--budget-s`` is skipped and says so; ``--out-json`` is rewritten after each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step_parts as parts

VARIANTS = ("off", "compile", "parallel_block", "attn_window", "prefetch_off")
# (shape, seq_len, micro_batch, global_batch, warmup, steps) on CUDA, and for --smoke
GPU_DEFAULTS = ("1b", 2048, 4, 8, 4, 12)
SMOKE_DEFAULTS = ("tiny", 32, 2, 4, 1, 3)


def flags(variant: str, seq_len: int) -> list[str]:
    return {
        "off": [],
        "compile": ["--train.compile=true"],
        "parallel_block": ["--model.parallel_block=true"],
        "attn_window": [f"--model.attn_window={window(seq_len)}"],
        "prefetch_off": ["--data.prefetch=0"],
    }[variant]


def window(seq_len: int) -> int:
    return max(1, seq_len // 4)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parts.add_run_arguments(p, GPU_DEFAULTS[0], "variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--budget-s", type=float, default=420.0, help="start no variant after this many seconds")
    p.add_argument("--section-timeout", type=float, default=180.0, help="seconds per run")
    a = p.parse_args(argv)
    import torch

    a.device = "cpu" if a.smoke else "cuda"
    if not a.smoke and not torch.cuda.is_available():
        p.exit(
            2, "benchmarks/gpu_techniques.py needs CUDA (torch.cuda.is_available() is False); --smoke runs on the CPU\n"
        )
    parts.fill_run_defaults(p, a, SMOKE_DEFAULTS if a.smoke else GPU_DEFAULTS)
    a.variants = parts.chosen(p, a.variants, VARIANTS, "variants")
    return a


def measure(a: argparse.Namespace, emit=lambda r: None) -> dict:
    from stalwart.plan.compute import flops_per_token

    start = time.perf_counter()
    r, work, data = parts.run_header(a, "stalwart-gpu-techniques-")
    n_params, peak = r["model"]["n_params"], r["peak_flops"]
    tokens_per_step = a.global_batch * a.seq_len
    r["variants"] = {}
    for v in a.variants:
        if time.perf_counter() - start > a.budget_s:
            r["variants"][v] = {"skipped": f"over the {a.budget_s:.0f} s budget"}
            continue
        t0 = time.perf_counter()
        fpt = flops_per_token(
            n_params,
            a.shape["n_layers"],
            a.shape["dim"],
            a.seq_len,
            window=window(a.seq_len) if v == "attn_window" else 0,
        )
        try:
            out = work / v
            parts.checked(
                parts.run(parts.train_cmd(a, data, out, a.warmup + a.steps, *flags(v, a.seq_len)), a.section_timeout)
            )
            step_s = statistics.median(row["step_time_s"] for row in parts.records(out, a.warmup))
            tps = tokens_per_step / step_s
            x = {"flags": flags(v, a.seq_len), "step_s": step_s, "tokens_per_s": tps, "flops_per_token": fpt}
            x["mfu"] = fpt * tps / peak if peak else None
            summary = json.loads((out / "summary.json").read_text())
            x["attention"] = summary.get("attention", {}).get("backend")
        except parts.SectionError as e:
            x = {"error": str(e)}
        x["wall_s"] = round(time.perf_counter() - t0, 1)
        r["variants"][v] = x
        off = r["variants"].get("off", {}).get("tokens_per_s")
        for y in r["variants"].values():
            if "tokens_per_s" in y:
                y["vs_off"] = y["tokens_per_s"] / off if off else None
        emit(r)
    r["wall_s"] = round(time.perf_counter() - start, 1)
    return r


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)

    emit = parts.writer(a.out_json)
    r = measure(a, emit)
    emit(r)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['device']}, {r['model']['shape']} ({r['model']['n_params'] / 1e6:.0f}M), seq {r['seq_len']}, "
            f"{r['global_batch']} sequences a step"
        )
        for name, x in r["variants"].items():
            if "tokens_per_s" not in x:
                print(f"  {name:15s} {x.get('error') or x.get('skipped')}")
                continue
            mfu = f"MFU {x['mfu']:.1%}" if x["mfu"] is not None else "MFU n/a"
            vs = f"{x['vs_off']:.3f} × off" if x.get("vs_off") else ""
            print(f"  {name:15s} {x['tokens_per_s']:>12,.0f} tok/s  {mfu}  {vs}  ({x['wall_s']} s)")
    failed = [n for n, x in r["variants"].items() if "error" in x]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
