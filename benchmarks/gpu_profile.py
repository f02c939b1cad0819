"""Where does a training step of stalwart's LLaMA-style model spend its GPU time? A diagnostic for
the gap to torchtitan's step (docs/gpu.md: 0.312 s against 0.250 s at 280M), not a claim.

    python benchmarks/gpu_profile.py [--json] [--out F]   # CUDA: the 280M shape of gpu_step.py, seq 2048
    python benchmarks/gpu_profile.py --smoke              # the CPU, tiny shape: runs every line

Prints (and writes to ``--out``) three things:
- the profiler's table of one plain-loop step (forward + backward of every micro-batch, clipping,
  fused AdamW), the ops sorted by their own device time;
- ``rope``: forward + backward of ``models.llama.apply_rope`` on one layer's q against the same
  rotation as a complex multiply in fp32 (torchtitan's way), median milliseconds;
- ``attention``: forward + backward of SDPA with ``enable_gqa`` against k and v repeated to the
  query heads first (torchtitan's way), median milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_parts import SHAPES, plain_model, plain_step

from stalwart.models.llama import apply_rope, rope_tables


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the CPU, the tiny shape, seq 32: runs every line")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default 280m (smoke: tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (smoke: 32)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 8; smoke 2)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    p.add_argument("--repeats", type=int, default=20, help="timings per variant in the micro-benchmarks")
    p.add_argument("--rows", type=int, default=30, help="rows of the profiler table")
    p.add_argument("--out", default="", help="also write the report here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    a = p.parse_args(argv)
    a.device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    a.shape = a.shape or ("tiny" if a.smoke else "280m")
    a.seq_len = a.seq_len or (32 if a.smoke else 2048)
    a.micro_batch = a.micro_batch or (2 if a.smoke else 8)
    if a.smoke:
        a.warmup, a.repeats = 1, 3
    return a


def timed_ms(fn: Callable[[], None], device: str, repeats: int) -> float:
    """Median wall milliseconds of ``fn`` with the device synchronised around each call."""
    fn()  # warm: kernels chosen, caches filled
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_step(a: argparse.Namespace) -> tuple[str, int]:
    """The profiler's table of one step of gpu_step.py's plain loop (random tokens) after ``--warmup``
    steps; the model's size."""
    model, params, opt = plain_model(SHAPES[a.shape], 257, a.seq_len, a.device)
    batch = torch.randint(0, 257, (a.micro_batches, a.micro_batch, a.seq_len + 1), device=a.device)

    def step() -> None:
        plain_step(model, params, opt, list(batch), a.device)

    for _ in range(a.warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if a.device == "cuda":
        torch.cuda.synchronize()
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if a.device == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=a.rows, max_name_column_width=60)
    return table, sum(p.numel() for p in params)


def rope_variants(a: argparse.Namespace) -> dict[str, float]:
    """apply_rope (fp32 pairs, ~10 elementwise kernels) against one complex multiply, fwd + bwd."""
    hd = SHAPES[a.shape]["dim"] // SHAPES[a.shape]["n_heads"]
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    shape = (a.micro_batch, a.seq_len, SHAPES[a.shape]["n_heads"], hd)
    x = torch.randn(shape, device=a.device, dtype=dtype, requires_grad=True)
    tables = rope_tables(hd, a.seq_len, 10000.0, a.device)
    freqs = torch.polar(torch.ones_like(tables[..., 0]), torch.atan2(tables[..., 1], tables[..., 0]))

    def complex_rope(t: torch.Tensor) -> torch.Tensor:
        tc = torch.view_as_complex(t.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(tc * freqs[: t.shape[1], None]).flatten(-2).type_as(t)

    out = {}
    grad = torch.ones(shape, device=a.device, dtype=dtype)
    for name, fn in (("apply_rope_ms", lambda t: apply_rope(t, tables)), ("complex_ms", complex_rope)):
        out[name] = timed_ms(lambda fn=fn: fn(x).backward(grad), a.device, a.repeats)
    with torch.no_grad():
        out["max_abs_diff"] = float((complex_rope(x).float() - apply_rope(x, tables).float()).abs().max())
    return out


def attention_variants(a: argparse.Namespace) -> dict[str, float | str]:
    """SDPA with enable_gqa against k/v repeated to the query heads, causal, fwd + bwd."""
    s = SHAPES[a.shape]
    hd, rep = s["dim"] // s["n_heads"], s["n_heads"] // s["n_kv_heads"]
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32

    def make(heads: int) -> torch.Tensor:
        return torch.randn(a.micro_batch, heads, a.seq_len, hd, device=a.device, dtype=dtype, requires_grad=True)

    q, k, v = make(s["n_heads"]), make(s["n_kv_heads"]), make(s["n_kv_heads"])
    grad = torch.ones_like(q)

    def gqa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1).backward(grad)

    def repeated() -> None:
        kr, vr = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        F.scaled_dot_product_attention(q, kr, vr, is_causal=True).backward(grad)

    out: dict[str, float | str] = {
        "enable_gqa_ms": timed_ms(gqa, a.device, a.repeats),
        "repeat_kv_ms": timed_ms(repeated, a.device, a.repeats),
    }
    if a.device == "cuda":  # which kernel each one ran
        for name, fn in (("enable_gqa_kernels", gqa), ("repeat_kv_kernels", repeated)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            names = {e.key for e in prof.key_averages() if "attention" in e.key.lower() or "flash" in e.key.lower()}
            out[name] = ", ".join(sorted(names))[:400]
    return out


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    t0 = time.perf_counter()
    table, n_params = profile_step(a)
    r = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "shape": a.shape,
        "n_params": n_params,
        "tokens_per_step": a.micro_batches * a.micro_batch * a.seq_len,
        "rope": rope_variants(a),
        "attention": attention_variants(a),
    }
    r["wall_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(r, indent=1) if a.json else f"{table}\n{json.dumps(r, indent=1)}"
    if a.out:
        Path(a.out).write_text(f"{table}\n{json.dumps(r, indent=1)}\n")
    print(text)


if __name__ == "__main__":
    main()
