"""A finished run's summary.json: what ran (device, layout, model, attention kernel), how fast, the
final weights' and optimizer's hashes (the bitwise-resume checks compare them), and what the
checkpoints and the guard did. Written by rank 0; every rank returns it (the hashes are collectives)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stalwart.train.compile import attention_backend

if TYPE_CHECKING:
    from stalwart.checkpoint.checkpointer import Checkpointer
    from stalwart.train.trainer import Trainer


def write_summary(tr: Trainer, wall_s: float) -> dict[str, Any]:
    t, out = tr.cfg.train, Path(tr.cfg.train.out_dir)
    final_hash = tr.weights_hash()
    step_times = tr.metrics.step_times
    tokens_per_step = t.global_batch * tr.cfg.data.seq_len
    summary = {
        "steps": tr.step,
        "startup_s": tr.phases.seconds,  # this process's start, phase by phase (a restart's own)
        "world_size": tr.env.world_size,
        "device": str(tr.env.device),  # cuda:N or cpu, with the backend: what the run really used
        "backend": tr.env.backend,
        "dp_mode": tr.cfg.parallel.dp_mode,
        "layout": tr.plan.summary(),
        "model": tr.cfg.model.name,
        "n_params": tr.n_params,
        "grad_accum": tr.accum,
        "global_batch": t.global_batch,
        "seq_len": tr.cfg.data.seq_len,
        "final_loss": tr.metrics.last_loss if step_times else None,
        "median_step_time_s": statistics.median(step_times) if step_times else None,
        "tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
        "wall_s": wall_s,
        "samples_consumed": tr.sampler.consumed,
        "compiled_blocks": tr.compiled_blocks,
        "attention": attention_report(tr),
        "prefetch": tr.cfg.data.prefetch,
        "final_hash": final_hash,
        "optim_hash": tr.optimizer_hash(),
        "metrics": str(out / "metrics.jsonl"),
    }
    if tr.ckpt is not None:
        summary["checkpoint"] = checkpoint_report(tr.ckpt)
    if tr.guard is not None:
        summary["guard"] = tr.guard.report()
    if tr.env.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def attention_report(tr: Trainer) -> dict[str, Any]:
    """The SDPA kernel this run's attention used (summary.json "attention")."""
    dtype = torch.bfloat16 if isinstance(tr.autocast(), torch.autocast) else torch.float32
    a, c = tr.model_args, tr.cfg
    out = attention_backend(a, c.train.micro_batch, c.data.seq_len, tr.plan.layout.tp, dtype, tr.pm.device)
    if tr.compiled_blocks:
        out["how"] += "; the blocks are compiled: inductor may lower attention itself"
    return out


def checkpoint_report(ckpt: Checkpointer) -> dict[str, Any]:
    info, w = ckpt.last_restore, ckpt.writer.stats
    return {
        "restored_from": info.source if info else "disabled",
        "restore_step": info.step if info else 0,
        "restore_s": info.seconds if info else 0.0,
        "restore_detail": info.detail if info else "",
        "restore_skipped": info.skipped if info else [],
        "snapshots": w["snapshots"],
        "snapshots_skipped": w["skipped"],
        "hook_wait_s": w["wait_s"],  # steps held for a copy; a save call's own waits are in save_call_s
        "end_wait_s": w["end_wait_s"],  # the final wait for the last snapshot (and replica sync, rollback)
        "save_call_s": ckpt.stats["save_s"],
        "replica_wait_s": ckpt.stats["replica_wait_s"],  # of save_call_s: --replica-sync's waits
        "persist_requests": ckpt.stats["persist_requests"],
        "dir": ckpt.storage.url,
    }
