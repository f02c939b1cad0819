"""The job that `benchmarks/recovery.py` runs under both launchers: a 4-layer GPT (d_model 256) trained
with DDP (or FSDP2: ``--fsdp``) over gloo on deterministic synthetic tokens, checkpointed one of three ways.

    torchrun --nproc-per-node 2 benchmarks/recovery_job.py --ckpt dcp --dcp-every 20 --log-dir D
    python -m stalwart run --nproc-per-node 2 benchmarks/recovery_job.py --ckpt flash --log-dir D

``--ckpt flash``  stalwart's Checkpointer: memory snapshot every step, persisted every
                  ``--persist-every`` steps by the keeper; restore = memory → storage → fresh.
``--ckpt dcp``    what a torchrun user writes: synchronous ``torch.distributed.checkpoint.save`` of
                  ``get_state_dict`` every ``--dcp-every`` steps into ``CKPT_DIR/step-N``, then rank 0
                  atomically points ``CKPT_DIR/latest`` at it; restore = ``dcp.load`` of ``latest``.
``--ckpt none``   no checkpoints (a restart starts over).

Batch *s* of rank *r* is drawn from a generator seeded with (seed, s, r), so a resumed run sees
exactly the data it would have seen. Faults come from ``STALWART_CHAOS`` at point ``step``, checked
right after step *s* completed and was checkpointed (as ``stalwart train`` does); the job logs the
fault time itself just before firing, so the benchmark measures both launchers the same way.

Every rank appends JSON lines to ``LOG_DIR/rank<r>.jsonl`` (append mode, all attempts in one file):
``{"ev": "start", "attempt", "t_proc" (script started), "t_import" (imports done), "t_cuda" (CUDA
context up; = t_import on the CPU), "t_pg" (process group up, NCCL's communicator included), "t_built"
(model, DDP, optimizer), "t_restored", "resume_step", "restore_s", "source"}`` once per process, then
rank 0 only ``{"ev": "step", "step", "t", "dt", "save_s", "attempt", "injected_s"}`` per step (``t`` =
time.time() when the step and its checkpoint call finished, ``dt`` = forward+backward+all-reduce+optimizer
seconds, ``save_s`` = seconds in the checkpoint call, ``injected_s`` = seconds the previous step's injected
fault took, e.g. a benchmark's ``slow`` pacing, which waits for no snapshot; ``safe`` = the Checkpointer's
``safe_step``, the newest step a lost node cannot take, under ``--replica-sync``/``--replica-overlap``),
``{"ev": "fault", "step", "t", "action"}`` from the rank that fires a fault, and ``{"ev": "end"}``.
"""

from __future__ import annotations

import time

T_PROC = time.time()  # before the heavy imports: what a cold worker start costs

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import stalwart  # noqa: E402
from stalwart import chaos  # noqa: E402
from stalwart.models.llama import Transformer  # noqa: E402
from stalwart.models.registry import model_args  # noqa: E402

# Deterministic kernels, as `stalwart train` sets them. On this torch this call imports
# torch._dynamo/_inductor (2-3 s of a cold start; AdamW's first step would import them anyway), so it
# is counted with the imports.
torch.use_deterministic_algorithms(True)
T_IMPORT = time.time()
GPT = dict(
    dim=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=None,
    ffn_hidden=None,
    mlp="gelu",
    norm="layernorm",
    pos="learned",
    bias=True,
    tie_embeddings=True,
    vocab_size=257,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", choices=("flash", "dcp", "none"), default="flash")
    p.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint storage directory")
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dcp-every", type=int, default=20)
    p.add_argument("--persist-every", type=int, default=50, help="flash: keeper persists every N steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per block) instead of DDP")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: cuda:LOCAL_RANK, NCCL with a GPU per local rank (gloo on shared GPUs); the restart's "
        "CUDA context creation and NCCL communicator set-up are logged apart (t_cuda, t_pg)",
    )
    return p.parse_args(argv)


class Log:
    def __init__(self, log_dir: Path, rank: int) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.f = open(log_dir / f"rank{rank}.jsonl", "a", buffering=1)

    def write(self, **record: object) -> None:
        self.f.write(json.dumps(record) + "\n")


def batch(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    gen = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 4099 + rank)
    return torch.randint(0, GPT["vocab_size"], (args.batch, args.seq_len + 1), generator=gen)


class DcpCheckpoints:
    """Synchronous DCP saves every K steps and resume from the newest complete one."""

    def __init__(self, root: Path, every: int) -> None:
        self.root, self.every = root, every
        self.root.mkdir(parents=True, exist_ok=True)

    def restore(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        latest = self.root / "latest"
        if not latest.exists():
            return 0
        step = int(latest.read_text())
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(self.root / f"step-{step:06d}"))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return step

    def save(self, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
        if step % self.every:
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(self.root / f"step-{step:06d}"))
        dist.barrier()
        if rank == 0:  # the commit point: only a finished save is ever resumed from
            tmp = self.root / "latest.tmp"
            tmp.write_text(str(step))
            os.replace(tmp, self.root / "latest")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device, backend = torch.device("cpu"), "gloo"
    if args.device == "cuda":  # the CUDA context first, so its cost is seen apart from NCCL's
        local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        device = torch.device("cuda", local % gpus)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
        backend = "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo"
    t_cuda = time.time()
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    dist.barrier()  # NCCL creates its communicator at the first collective: count it as process-group set-up
    t_pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = Log(args.log_dir, rank)

    margs = model_args("debug", **GPT, max_seq_len=args.seq_len)
    model = Transformer(margs)
    model.init_weights(args.seed)
    model.to(device)
    if args.fsdp:  # FSDP2: each block and the root sharded over every rank (a lost node's shards: only there)
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        ddp = fully_shard(model)
    else:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    t_built = time.time()

    ckpt: object = None
    source = "fresh"
    if args.ckpt == "flash":
        from stalwart.checkpoint import Checkpointer

        ckpt = Checkpointer(
            str(args.ckpt_dir),
            memory_every=1,
            persist_every_steps=args.persist_every,
            keeper_log=args.log_dir / "keeper.log",
        )
        state = {"model": ddp, "optim": optim}
        start = ckpt.restore(state)
        source = ckpt.last_restore.source if ckpt.last_restore else "fresh"
    elif args.ckpt == "dcp":
        ckpt = DcpCheckpoints(args.ckpt_dir, args.dcp_every)
        start = ckpt.restore(ddp, optim)
        source = "storage" if start else "fresh"
    else:
        start = 0
    t_restored = time.time()
    log.write(
        ev="start",
        attempt=attempt,
        rank=rank,
        world=world,
        pid=os.getpid(),
        t_proc=T_PROC,
        t_import=T_IMPORT,
        t_cuda=t_cuda,
        t_pg=t_pg,
        t_built=t_built,
        t_restored=t_restored,
        resume_step=start,
        source=source,
        restore_s=t_restored - t_built,
    )

    ok = False
    injected_s = 0.0  # the last step's injected fault (the benchmarks' pacing): not the job's own time
    try:
        for step in range(start + 1, args.steps + 1):
            t0 = time.perf_counter()
            tokens = batch(step, rank, args).to(device, non_blocking=True)
            logits = ddp(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's time, not its launch's
            dt = time.perf_counter() - t0
            t1 = time.perf_counter()
            if args.ckpt == "flash":
                ckpt.save(step, state, persist=True if step == args.steps else None)
            elif args.ckpt == "dcp":
                ckpt.save(step, ddp, optim, rank)
            save_s = time.perf_counter() - t1
            stalwart.report(step, loss=loss.item(), compute_s=dt)
            if rank == 0:
                log.write(
                    ev="step",
                    step=step,
                    t=time.time(),
                    dt=dt,
                    save_s=save_s,
                    attempt=attempt,
                    loss=round(loss.item(), 4),
                    injected_s=injected_s,
                    safe=ckpt.safe_step if args.ckpt == "flash" else None,
                )
            fault, injected_s = chaos.due("step", step=step, rank=rank), 0.0
            if fault is not None:
                t_fault = time.perf_counter()
                if args.ckpt == "flash" and fault.action != "slow":
                    ckpt.wait()  # as stalwart train does: the snapshot of this step is complete
                log.write(ev="fault", step=step, t=time.time(), action=fault.action, attempt=attempt)
                log.f.flush()
                fault.fire()
                injected_s = time.perf_counter() - t_fault
        stalwart.finished()
        if args.ckpt == "flash":
            ckpt.wait(persist=True)
        ok = True
    finally:
        if args.ckpt == "flash":
            ckpt.close(success=ok)
    log.write(ev="end", t=time.time(), attempt=attempt)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
