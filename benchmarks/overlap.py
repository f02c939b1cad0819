"""Claim: stalwart overlaps data-parallel communication with compute by default (DDP gradient buckets
all-reduced during the backward, FSDP2 all-gathers prefetched a block ahead), and how much of the
communication stays exposed with and without it is measured here, baselines in the same run.

One torchrun job of ``--nproc`` gloo ranks (CPU) times, round after round, interleaved so drift on a
shared machine hits every variant alike:

    compute       the same model and local batch without any wrapper: forward, backward, AdamW
                  (no collective at all; each rank alone): the compute-only time
    ddp_overlap   DDP, parallel.ddp_bucket_mb = 25 (default): buckets all-reduce as they fill
    ddp_serial    DDP, one bucket larger than the model: its all-reduce starts after the backward
    fsdp_prefetch FSDP2 (ZeRO-3), parallel.fsdp_prefetch = 1 (default): explicit prefetch
    fsdp_implicit FSDP2, parallel.fsdp_prefetch = 0: FSDP2's implicit prefetch only (on the CPU the
                  host does not run ahead of a device, so each block's all-gather waits in its forward)

Exposed communication per step = step time − compute-only time of the same round (each a median over
steps; the slowest rank's), then the median over rounds: pairing within a round cancels most of the drift
of a shared machine. On a 2-core host shared with other work, gloo's communication threads compete with
compute for the same cores, so the CPU figures bound what overlap can show; the mechanism is the
same on CUDA/NCCL, where communication runs on its own streams and the gain is larger.

    python benchmarks/overlap.py --json
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

VARIANTS = ("compute", "ddp_overlap", "ddp_serial", "fsdp_prefetch", "fsdp_implicit")
PAIRS = (("ddp_overlap", "ddp_serial"), ("fsdp_prefetch", "fsdp_implicit"))


# -- worker (one rank of a torchrun job) ----------------------------------------------------------
def build(variant: str, a: argparse.Namespace, mesh_cache: dict) -> tuple:
    import torch

    from stalwart.models import build_model, model_args
    from stalwart.plan.parallel import layout_from_config
    from stalwart.train.parallel import ParallelOptions, build_mesh, parallelize

    margs = model_args(a.model, vocab_size=257, max_seq_len=a.seq_len, n_layers=a.layers)
    model = build_model(a.model, margs)
    model.init_weights(0)
    if variant == "compute":
        return model, list(model.parameters()), None
    mode = "ddp" if variant.startswith("ddp") else "fsdp"
    layout = layout_from_config({"dp": a.world}, a.world, mode)
    mesh = mesh_cache.setdefault(mode, build_mesh(layout))
    big = 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1
    options = ParallelOptions(
        micro_batch=a.micro_batch,
        ddp_bucket_mb=25.0 if variant == "ddp_overlap" else big,
        fsdp_prefetch=1 if variant == "fsdp_prefetch" else 0,
    )
    pm = parallelize(model, layout, mesh, options, device=torch.device("cpu"))
    return pm.parts[0], list(pm.module.parameters()), pm


def time_steps(variant: str, a: argparse.Namespace, mesh_cache: dict) -> list[float]:
    import torch
    import torch.nn.functional as F

    module, params, pm = build(variant, a, mesh_cache)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(a.steps):
        ids = torch.randint(0, 257, (a.micro_batch, a.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        if pm is None:
            logits = module(ids[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        else:
            pm.forward_backward(ids[:, :-1], ids[:, 1:])
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[a.warmup :]


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.dist import init_distributed

    torch.set_num_threads(1)
    env = init_distributed("gloo")
    a.world = env.world_size
    mesh_cache: dict = {}
    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(a.rounds):
        for variant in VARIANTS:
            dist.barrier()
            rounds[variant].append(statistics.median(time_steps(variant, a, mesh_cache)))
    # the step is as slow as its slowest rank: take the max over ranks of each round's median
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, rounds)
    if env.rank == 0:
        slowest = {v: [max(g[v][i] for g in gathered) for i in range(a.rounds)] for v in VARIANTS}
        Path(a.out).write_text(json.dumps(slowest))
    dist.barrier()
    dist.destroy_process_group()


# -- driver -----------------------------------------------------------------------------------------
def report(rounds: dict[str, list[float]], a: argparse.Namespace) -> dict:
    step = {v: statistics.median(rounds[v]) for v in VARIANTS}
    compute = step["compute"]
    paired = {v: [t - c for t, c in zip(rounds[v], rounds["compute"])] for v in VARIANTS if v != "compute"}
    exposed = {v: max(0.0, statistics.median(d)) for v, d in paired.items()}
    out: dict = {
        "claim": "exposed data-parallel communication per step, with and without overlap (2 gloo CPU ranks)",
        "setup": {k: getattr(a, k) for k in ("nproc", "model", "layers", "seq_len", "micro_batch", "steps", "rounds")},
        "step_s": step,
        "step_s_rounds": rounds,
        "compute_only_s": compute,
        "exposed_comm_s": exposed,
        "exposed_comm_s_rounds": paired,
        "exposed_comm_fraction": {v: exposed[v] / step[v] for v in exposed},
    }
    for on, off in PAIRS:
        out[f"{on}_vs_{off}"] = {
            "exposed_ratio": exposed[on] / exposed[off] if exposed[off] > 0 else None,
            "step_speedup": statistics.median(b / a for a, b in zip(rounds[on], rounds[off])),  # paired
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="small")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant and round (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    if a.worker:
        a.steps += a.warmup
        worker(a)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rounds.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc)]
        cmd += [__file__, "--worker", f"--out={out}", f"--model={a.model}", f"--layers={a.layers}"]
        cmd += [f"--seq-len={a.seq_len}", f"--micro-batch={a.micro_batch}", f"--steps={a.steps}"]
        cmd += [f"--warmup={a.warmup}", f"--rounds={a.rounds}"]
        result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if result.returncode != 0:
            sys.stderr.write(result.stderr[-4000:])
            return 1
        rounds = json.loads(out.read_text())
    res = report(rounds, a)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for v in VARIANTS:
            extra = "" if v == "compute" else f"  exposed comm {res['exposed_comm_s'][v] * 1e3:7.1f} ms"
            print(f"{v:14s} step {res['step_s'][v] * 1e3:7.1f} ms{extra}")
        for on, off in PAIRS:
            r = res[f"{on}_vs_{off}"]
            print(f"{on} vs {off}: exposed ratio {r['exposed_ratio']}, step speedup {r['step_speedup']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
