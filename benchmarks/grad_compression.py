"""Claim: DDP gradient compression (bf16 / fp16 casts, PowerSGD, ALQ) is a config switch whose effect on
the loss and on the step time is measured, against uncompressed DDP in the same run.

Each hook trains the same model on the same global batches (real data pipeline, AdamW, clipping)
with 2 DDP ranks over gloo, ``--repeats`` times in fresh torchrun jobs. Reported per hook (medians
over repeats): final loss (mean of the last 5 steps), step time (median over steps after warm-up),
and the bytes each rank all-reduces per step (from the bucket sizes: fp32 = 4 B/param, bf16/fp16 =
2 B/param, PowerSGD = rank·(n+m) floats per n×m matrix + 1-D tensors uncompressed; ALQ: the
all-gather payload its hook counted, median over steps: ``alq_bits`` per value + one fp32 norm per
2048 values + the levels on refit steps). ``ring_mb_sent_per_rank`` is what a ring algorithm then
sends per rank: 2(W-1)/W × the all-reduce bytes, but (W-1) × the all-gather payload for ALQ — its
saving shrinks as the world grows (4 bits: 8× at W = 2, none at W = 16).

On one CPU host the all-reduce is a loopback copy, so fewer bytes barely change the step time and
PowerSGD's extra matmuls (and its serialised per-bucket collectives on gloo) can make it slower;
across real networks the byte ratio is what matters. The loss ratio is the cost side either way.

    python benchmarks/grad_compression.py --json
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

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "prepared" / "stdlib-byte"
HOOKS = ("none", "bf16", "fp16", "powersgd", "alq")


# -- worker (one rank of a torchrun job) ----------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.data import GlobalSampler, TokenDataset
    from stalwart.dist import init_distributed
    from stalwart.models import build_model, model_args
    from stalwart.train.parallel import Layout, ParallelOptions, build_mesh, parallelize

    torch.set_num_threads(1)
    env = init_distributed("gloo")
    data = TokenDataset(a.data, a.seq_len)
    model = build_model(a.model, model_args(a.model, vocab_size=data.vocab_size, max_seq_len=a.seq_len))
    model.init_weights(0)
    layout = Layout(dp_replicate=env.world_size)
    pm = parallelize(
        model,
        layout,
        build_mesh(layout),
        ParallelOptions(
            micro_batch=a.micro_batch,
            compress=a.hook,
            powersgd_rank=a.powersgd_rank,
            alq_bits=a.alq_bits,
            alq_update_every=a.alq_update_every,
        ),
    )
    params = list(pm.module.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        foreach=True,
    )
    sampler = GlobalSampler(len(data), a.global_batch, seed=1234)
    losses, times = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        inputs, targets = data.batch(sampler.next_batch(pm.dp_rank, pm.dp_size))
        loss = pm.forward_backward(inputs, targets)
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    if env.rank == 0:
        sent = comm_bytes(params, a.hook, a.powersgd_rank)
        if a.hook == "alq":  # counted by the hook; step 0 ran on DDP's first-pass buckets
            sent = int(statistics.median(pm.hook_state.step_bytes[1:]))
        Path(a.out).write_text(json.dumps({"losses": losses, "times": times, "comm_bytes": sent}))
    dist.destroy_process_group()


def comm_bytes(params: list, hook: str, rank: int) -> int:
    """Bytes one rank hands to all-reduce per optimizer step (one sync per step)."""
    total = 0
    for p in params:
        n = p.numel()
        if hook == "none":
            total += 4 * n
        elif hook in ("bf16", "fp16"):
            total += 2 * n
        elif p.ndim >= 2:  # PowerSGD: P (n×r) and Q (m×r) for each matrix
            rows = p.shape[0]
            cols = n // rows
            total += 4 * rank * (rows + cols) if rank * (rows + cols) < n else 4 * n
        else:
            total += 4 * n
    return total


# -- driver -----------------------------------------------------------------------------------------
def run_once(hook: str, a: argparse.Namespace, tmp: Path, i: int) -> dict:
    out = tmp / f"{hook}-{i}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(a.nproc),
        __file__,
        "--worker",
        f"--hook={hook}",
        f"--out={out}",
        f"--data={a.data}",
        f"--model={a.model}",
        f"--steps={a.steps}",
        f"--seq-len={a.seq_len}",
        f"--global-batch={a.global_batch}",
        f"--micro-batch={a.micro_batch}",
        f"--powersgd-rank={a.powersgd_rank}",
        f"--alq-bits={a.alq_bits}",
        f"--alq-update-every={a.alq_update_every}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{hook} run failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarise(runs: list[dict], warmup: int, hook: str, world: int) -> dict:
    finals = [statistics.mean(r["losses"][-5:]) for r in runs]
    steps = [statistics.median(r["times"][warmup:]) for r in runs]
    return {
        "final_loss": statistics.median(finals),
        "final_loss_runs": finals,
        "step_time_s": statistics.median(steps),
        "step_time_runs_s": steps,
        "allreduce_mb_per_step": runs[0]["comm_bytes"] / 1e6,  # ALQ: its all-gather payload
        "ring_mb_sent_per_rank": runs[0]["comm_bytes"]
        / 1e6
        * ((world - 1) if hook == "alq" else 2 * (world - 1) / world),
        "loss_curve": runs[0]["losses"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hook", default="none", choices=HOOKS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--model", default="debug")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--alq-bits", type=int, default=4)
    p.add_argument("--alq-update-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hooks", default=",".join(HOOKS))
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    from stalwart.data import ensure_default_corpus

    if a.data == str(DATA):
        ensure_default_corpus(DATA)
    hooks = [h for h in a.hooks.split(",") if h]
    if "none" not in hooks:
        hooks.insert(0, "none")
    warmup = min(5, a.steps // 3)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for hook in hooks:
            runs = [run_once(hook, a, Path(tmp), i) for i in range(a.repeats)]
            results[hook] = summarise(runs, warmup, hook, a.nproc)
    base = results["none"]
    ratios = {
        h: {
            "step_time": r["step_time_s"] / base["step_time_s"],
            "final_loss": r["final_loss"] / base["final_loss"],
            "allreduce_bytes": r["allreduce_mb_per_step"] / base["allreduce_mb_per_step"],
            "ring_bytes": r["ring_mb_sent_per_rank"] / base["ring_mb_sent_per_rank"],
        }
        for h, r in results.items()
        if h != "none"
    }
    report = {
        "benchmark": "grad_compression",
        "claim": "DDP gradient compression: effect on loss and step time",
        "config": {
            "model": a.model,
            "ranks": a.nproc,
            "backend": "gloo",
            "steps": a.steps,
            "seq_len": a.seq_len,
            "global_batch": a.global_batch,
            "micro_batch": a.micro_batch,
            "powersgd_rank": a.powersgd_rank,
            "alq_bits": a.alq_bits,
            "alq_update_every": a.alq_update_every,
            "repeats": a.repeats,
            "warmup_steps": warmup,
        },
        "baseline": base,
        "hooks": {h: r for h, r in results.items() if h != "none"},
        "ratios": ratios,
    }
    if a.json:
        print(json.dumps(report))
    else:
        print(
            f"{'hook':10s} {'final loss':>10s} {'step ms':>9s} {'MB/step':>8s} "
            f"{'loss ×':>7s} {'time ×':>7s} {'bytes ×':>8s}"
        )
        for h, r in results.items():
            q = ratios.get(h, {"final_loss": 1.0, "step_time": 1.0, "allreduce_bytes": 1.0})
            print(
                f"{h:10s} {r['final_loss']:10.4f} {r['step_time_s'] * 1e3:9.1f} {r['allreduce_mb_per_step']:8.2f} "
                f"{q['final_loss']:7.3f} {q['step_time']:7.3f} {q['allreduce_bytes']:8.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
