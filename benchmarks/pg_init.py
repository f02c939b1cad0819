"""Claim: how process-group start grows with the number of ranks, and what torch's faster paths save.

For each world size N (gloo, one host, every rank a forked process), three phases are timed, each as
the slowest rank sees it (a job starts when its last rank does):

- ``init``: ``stalwart.dist.init_distributed`` — env:// TCPStore rendezvous plus gloo's connections;
- ``barrier``: the first ``dist.barrier()``;
- ``mesh``: ``stalwart.train.parallel.build_mesh`` for pure data parallelism (the DeviceMesh with
  stalwart's six named axes and two flattened ones).

Variants, measured in the same run: ``eager`` (stalwart's path before this benchmark); ``lazy``
(``TORCH_GLOO_LAZY_INIT=1``: gloo connects a pair on its first use, so ``init`` stops opening N-1
connections per rank and the ring barrier opens only what it uses); ``local_sync`` (the mesh's groups
made by ``new_group(..., use_local_synchronization=True)``, one per axis and rank, the barrier only
among members — what DeviceMesh does on gloo is one world-wide ``new_group`` per sub-group, N of them
for every axis of size 1). The store requests per rank are counted in a second pass through a
counting wrapper around the same TCPStore, and a model ``ops/rank = a + b·N + c·log2 N`` is fitted
to them and extrapolated to 2,048 and 12,288 ranks (MegaScale: 1,047 s → 361 s on 2,048
GPUs after making the barrier O(n)).

What this box can and cannot show: N processes on 2 shared cores are CPU-bound, so times here are
upper bounds dominated by scheduling; the store-request counts are exact and machine-independent.
NCCL is not measured (no GPU): there stalwart already binds ``device_id`` (eager init), which lets
DeviceMesh create each axis with one ``split_group`` (ncclCommSplit) instead of N ``new_group`` calls.

    python benchmarks/pg_init.py --json [--ranks 2,4,8,16,32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

VARIANTS = ("eager", "lazy", "local_sync")
OPS = ("set", "get", "add", "wait", "check", "compare_set", "multi_get", "multi_set", "delete_key", "num_keys")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counting_store(inner):
    """A dist.Store that forwards each request to ``inner`` and counts it by kind (gloo and c10d call
    it from C++ through torch's Python-store trampoline)."""
    import torch.distributed as dist

    def forward(op: str):
        def method(self, *args):
            self.counts[op] += 1
            return getattr(inner, op)(*args)

        return method

    def init(self) -> None:
        dist.Store.__init__(self)
        self.counts = dict.fromkeys(OPS, 0)

    methods = {op: forward(op) for op in OPS}
    methods.update(
        __init__=init,
        set_timeout=lambda self, timeout: inner.set_timeout(timeout),
        timeout=property(lambda self: inner.timeout),
    )
    return type("CountingStore", (dist.Store,), methods)()


def local_sync_mesh(world: int) -> None:
    """The groups build_mesh needs for dp = world, each rank creating only its own, member-local barrier:
    six named axes (five of size 1, one of size N) and two flattened ones (sizes 1 and N)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for size in (1, world, 1, 1, 1, 1, 1, world):
        ranks = list(range(world)) if size == world else [rank]
        dist.new_group(ranks, use_local_synchronization=True)


def child(rank: int, world: int, port: int, variant: str, count: bool, t0: float, out) -> None:
    import torch.distributed as dist

    from stalwart.dist import init_distributed
    from stalwart.plan.parallel import Layout
    from stalwart.train.parallel import build_mesh

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    if variant != "eager":
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = None
    if count:
        tcp = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=300))
        store = counting_store(tcp)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    else:
        init_distributed("gloo", timeout_s=300)
    t_init = time.time()
    dist.barrier()
    t_barrier = time.time()
    if variant == "local_sync":
        local_sync_mesh(world)
    else:
        build_mesh(Layout(dp_replicate=world))
    t_mesh = time.time()
    dist.barrier()  # every rank done before rank 0's store goes away
    out.put(
        {
            "rank": rank,
            "init": t_init - t0,
            "barrier": t_barrier - t0,
            "mesh": t_mesh - t0,
            "ops": store.counts if store else None,
        }
    )
    dist.destroy_process_group()
    os._exit(0)  # gloo may abort at interpreter finalization


def trial(world: int, variant: str, count: bool) -> dict:
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()  # put() writes at once (os._exit would lose a Queue's feeder thread)
    port = free_port()
    t0 = time.time()
    procs = [ctx.Process(target=child, args=(r, world, port, variant, count, t0, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [out.get() for _ in procs]
    for p in procs:
        p.join(60)
    init = max(r["init"] for r in rows)
    barrier = max(r["barrier"] for r in rows)
    mesh = max(r["mesh"] for r in rows)
    result = {"init_s": init, "barrier_s": barrier - init, "mesh_s": mesh - barrier, "total_s": mesh}
    if count:
        result["ops_total"] = sum(sum(r["ops"].values()) for r in rows)
        result["ops_by_kind"] = {k: sum(r["ops"][k] for r in rows) for k in OPS if any(r["ops"][k] for r in rows)}
    return result


def fit_per_rank(xs: list[int], ys: list[float]) -> list[float]:
    """Least squares ``ops/rank = a + b·N + c·log2 N``: b is the O(N²) total (every rank reads every
    rank's address: gloo's eager full mesh), c the O(N log N) one (lazy pairs, tree-like algorithms)."""
    import numpy as np

    n = np.array(xs, float)
    basis = np.vstack([np.ones(len(xs)), n, np.log2(n)]).T
    coef = np.linalg.lstsq(basis, np.array(ys, float) / n, rcond=None)[0]
    return [round(float(c), 3) for c in coef]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--ranks", default="2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args()
    import torch  # noqa: F401  (imported once, before the forks)

    import stalwart.train.parallel  # noqa: F401

    ranks = [int(n) for n in a.ranks.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    results: dict[str, dict[int, dict]] = {v: {} for v in variants}
    for n in ranks:
        for v in variants:  # interleaved, so load drifts hit every variant alike
            runs = [trial(n, v, count=False) for _ in range(a.repeats)]
            counted = trial(n, v, count=True)
            results[v][n] = {
                k: statistics.median(r[k] for r in runs) for k in ("init_s", "barrier_s", "mesh_s", "total_s")
            } | {
                "total_runs_s": [r["total_s"] for r in runs],
                "store_ops": counted["ops_total"],
                "store_ops_by_kind": counted["ops_by_kind"],
            }
    models = {}
    for v in variants:
        a0, b1, c2 = fit_per_rank(ranks, [results[v][n]["store_ops"] for n in ranks])
        models[v] = {
            "store_ops_per_rank_fit": {"const": a0, "per_N": b1, "per_log2N": c2},
            "store_ops_per_rank_at": {m: a0 + b1 * m + c2 * math.log2(m) for m in (2048, 12288)},
        }
    ratios = {
        v: {n: results[v][n]["total_s"] / results["eager"][n]["total_s"] for n in ranks}
        for v in variants
        if v != "eager" and "eager" in results
    }
    ops_ratios = {
        v: {n: results[v][n]["store_ops"] / results["eager"][n]["store_ops"] for n in ranks}
        for v in variants
        if v != "eager" and "eager" in results
    }
    report = {
        "benchmark": "pg_init",
        "claim": "process-group start vs ranks (gloo, one host): eager vs torch's lazy / local-sync paths",
        "config": {"ranks": ranks, "repeats": a.repeats, "backend": "gloo", "cpus": os.cpu_count()},
        "results": results,
        "models": models,
        "ratios_total_time": ratios,
        "ratios_store_ops": ops_ratios,
    }
    if a.json:
        print(json.dumps(report))
    else:
        print(
            f"{'variant':11s} {'N':>4s} {'init s':>7s} {'barrier':>7s} {'mesh s':>7s} {'total':>7s} "
            f"{'ops':>7s} {'ops/rank':>8s}"
        )
        for v in variants:
            for n in ranks:
                r = results[v][n]
                print(
                    f"{v:11s} {n:4d} {r['init_s']:7.3f} {r['barrier_s']:7.3f} {r['mesh_s']:7.3f} "
                    f"{r['total_s']:7.3f} {r['store_ops']:7d} {r['store_ops'] / n:8.1f}"
                )
        for v, m in models.items():
            print(v, "ops per rank at 2048 / 12288:", {k: round(x, 1) for k, x in m["store_ops_per_rank_at"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
