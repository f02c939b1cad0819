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
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step_parts as parts

# The default on CUDA, sized so the benchmark takes ~2 minutes on an H100 (docs/gpu.md): ~280M
# parameters, dim 1024, 24 layers, GQA 16/8, SwiGLU 2816 (the LLaMA rule), on the byte corpus's 257 tokens.
SHAPES = {
    "280m": {"dim": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 2816},
    "1b": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 8192},  # Llama-3.2-1B blocks
    "tiny": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 256},
}
# (shape, seq_len, micro_batch, global_batch, warmup, steps) on CUDA, and for --smoke
GPU_DEFAULTS = ("280m", 2048, 8, 16, 5, 15)
SMOKE_DEFAULTS = ("tiny", 32, 2, 4, 1, 4)
SECTIONS = ("baseline", "stalwart", "checkpoint", "restore", "torchtitan")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out-json", default="", help="also write the JSON here, rewritten after each section")
    p.add_argument("--smoke", action="store_true", help="the CPU, a tiny shape and few steps: runs every line")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: CUDA if available")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak to divide by (a fake one on the CPU)")
    p.add_argument("--shape", choices=sorted(SHAPES), help=f"model shape (default {GPU_DEFAULTS[0]}; smoke: tiny)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--warmup", type=int, help="steps not timed, per run")
    p.add_argument("--steps", type=int, help="timed steps per run, after --warmup")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--section-timeout", type=float, default=240.0, help="seconds per subprocess of a section")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the memory snapshots (2 × the state)")
    p.add_argument("--work", default="", help="directory for data and runs (default: a temporary one)")
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
    defaults = SMOKE_DEFAULTS if a.smoke else GPU_DEFAULTS
    for key, value in zip(("shape", "seq_len", "micro_batch", "global_batch", "warmup", "steps"), defaults):
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.global_batch % a.micro_batch:
        p.error("--global-batch must be a multiple of --micro-batch")
    a.sections = [s for s in a.sections.split(",") if s]
    if unknown := set(a.sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    a.shape_name, a.shape = a.shape, SHAPES[a.shape]
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
    import torch

    from stalwart.data import ensure_default_corpus
    from stalwart.models import meta_param_count, model_args
    from stalwart.plan.compute import flops_per_token

    work = Path(a.work or tempfile.mkdtemp(prefix="stalwart-gpu-step-"))
    data = ensure_default_corpus(work / "data")
    a.vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    n_params = meta_param_count(model_args(parts.BASE_MODEL, vocab_size=a.vocab, max_seq_len=a.seq_len, **a.shape))
    fpt = flops_per_token(n_params, a.shape["n_layers"], a.shape["dim"], a.seq_len)
    peak, device_name, peak_source = parts.peak_flops(a.device, a.peak_tflops)
    tokens_per_step = a.global_batch * a.seq_len
    r: dict = {
        "device": device_name,
        "torch": torch.__version__,
        "model": {"base": parts.BASE_MODEL, "shape": a.shape_name, **a.shape, "n_params": n_params},
        "flops_per_token": fpt,
        "seq_len": a.seq_len,
        "global_batch": a.global_batch,
        "micro_batch": a.micro_batch,
        "warmup": a.warmup,
        "steps": a.steps,
        "peak_flops": peak,
        "peak_source": peak_source,
        "sections": {},  # wall seconds each section took, or why it did not run
        "work": str(work),
    }

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


def writer(path: str) -> Callable[[dict], None]:
    """Rewrite ``path`` atomically with the result so far (partial results survive a kill)."""

    def emit(r: dict) -> None:
        if path:
            tmp = f"{path}.tmp"
            Path(tmp).write_text(json.dumps(r, indent=1, default=str))
            os.replace(tmp, path)

    return emit


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
    r = measure(a, writer(a.out_json))
    if a.json:
        print(json.dumps(r, indent=1, default=str))
    else:
        report(r)


if __name__ == "__main__":
    main()
