"""The training loop: one class that owns model, optimizer, schedule, sampler and the step.

Everything that a checkpoint must capture is an attribute with ``state_dict``/``load_state_dict``
(model, optimizer, scheduler, sampler) plus ``step``; nothing else carries state between steps, which
is what makes bitwise resume possible.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import stalwart
from stalwart import chaos
from stalwart.config import Config
from stalwart.data import GlobalSampler, TokenDataset, ensure_default_corpus
from stalwart.data.sampler import parse_skip_ranges
from stalwart.dist import DistEnv
from stalwart.models import build_model, count_params
from stalwart.observe.progress import MetricsWriter, ProgressDisplay
from stalwart.observe.timers import SectionTimer
from stalwart.plan.compute import flops_per_token
from stalwart.train.guard import Verdict
from stalwart.train.optim import build_optimizer, build_scheduler
from stalwart.train.parallel import build_mesh, parallelize
from stalwart.train.resolve import rank0_plan, resolve
from stalwart.utils import state_dict_hash


def _deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` without its import of ``torch._inductor`` (only to
    set inductor's own flag; 2–3 s of every worker start, so of every recovery, on torch 2.13). The
    trainer does not compile; if something already imported inductor, the public call is used."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=False)
    else:
        torch._C._set_deterministic_algorithms(True, warn_only=False)


def configure_determinism(cfg: Config, env: DistEnv) -> None:
    t = cfg.train
    threads = t.threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(threads)
    random.seed(t.seed + env.rank)
    np.random.seed(t.seed + env.rank)
    torch.manual_seed(t.seed + env.rank)
    if t.deterministic:
        _deterministic_algorithms()
        if env.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    aux_loss: float = 0.0  # MoE load-balancing loss (mean over ranks), 0 for dense models


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv) -> None:
        cfg.validate()  # field checks before any work; the layout is checked by resolve() below
        self.cfg, self.env = cfg, env
        configure_determinism(cfg, env)
        if cfg.data.prepare_default and env.local_rank == 0:
            ensure_default_corpus(cfg.data.dir)
        dist.barrier()
        self.dataset = TokenDataset(cfg.data.dir, cfg.data.seq_len)
        self.plan = rank0_plan(resolve(cfg, env.world_size, self.dataset.vocab_size))  # the only planning
        self.model_args = self.plan.model_args
        if self.plan.why and env.is_main:
            print(self.plan.why, file=sys.stderr, flush=True)

        model = build_model(cfg.model.name, self.model_args)
        model.init_weights(cfg.train.seed)  # same weights on every rank, whatever the world size
        self.n_params = count_params(model)
        # DDP, FSDP2, TP, PP, EP, recompute: self.model is this rank's part under the unsplit model's
        # parameter names (what the optimizer and checkpoints see); self.pm runs the step.
        self.pm = parallelize(model, self.plan.layout, build_mesh(self.plan.layout), self.plan.options, env.device)
        self.model = self.pm.module
        self.accum = self.plan.grad_accum
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.sampler = GlobalSampler(len(self.dataset), cfg.train.global_batch, cfg.data.seed,
                                     cfg.data.shuffle, parse_skip_ranges(cfg.data.skip_samples))
        self.step = 0
        self.timer = SectionTimer(env.device)
        self.flops_per_token = flops_per_token(self.n_params, self.model_args.n_layers,
                                               self.model_args.dim, cfg.data.seq_len)
        # Everything a resume needs besides `step` (which restore returns).
        self.state = {"model": self.model, "optim": self.optimizer, "scheduler": self.scheduler,
                      "sampler": self.sampler}
        self.ckpt = self._build_checkpointer()
        self.guard: Any = None  # stalwart.train.rollback.TrainingGuard when guard.enabled
        if cfg.guard.enabled:  # validate() made sure checkpoints are on
            from stalwart.train.rollback import TrainingGuard

            self.guard = TrainingGuard(cfg.guard, self.ckpt, self.state, self.sampler, env.device)
            self.state["guard"] = self.guard.detector  # its baseline rolls back with the weights
        if self.ckpt is not None:
            self.step = self.ckpt.restore(self.state) if cfg.checkpoint.resume else self.ckpt.discard_snapshots()

    def _build_checkpointer(self) -> Any:
        c, out = self.cfg.checkpoint, Path(self.cfg.train.out_dir)
        if not c.enabled:
            return None
        from stalwart.checkpoint import Checkpointer

        out.mkdir(parents=True, exist_ok=True)
        persists = bool(c.persist_every_steps or c.persist_every_s)  # memory-only needs no keeper (multi-node)
        return Checkpointer(c.dir or str(out / "checkpoints"), memory_every=c.memory_every,
                            persist_every_steps=c.persist_every_steps, persist_every_s=c.persist_every_s,
                            keep_last=c.keep_last, keep_every=c.keep_every, shm_root=c.shm_dir,
                            keeper_idle_s=c.keeper_idle_s, keeper_log=out / "keeper.log", keeper=persists)

    # -- one optimizer step --------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.cfg.train.dtype
        if dtype == "bfloat16" or (dtype == "auto" and self.env.device.type == "cuda"):
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> StepResult | Verdict:
        """Forward/backward over this data-parallel rank's share of the next global batch (micro-batches,
        or the pipeline schedule), then the update — unless the guard judges the step bad: then its
        gradients are dropped and the verdict returned."""
        self.pm.train()
        with self.timer.section("data"):
            inputs, targets = self.dataset.batch(self.sampler.next_batch(self.pm.dp_rank, self.pm.dp_size))
        fault = chaos.due("loss", step=self.step + 1, rank=self.env.rank)  # chaos nan/spike: scale the loss
        loss = self.pm.forward_backward(inputs, targets, self._autocast, fault.scale if fault else 1.0, self.timer)
        # loss (global mean, broadcast from the last pipeline stage) and the grad norm (over all shards and
        # stages) are already equal everywhere; one all-reduce still makes every rank judge the very same
        # numbers (a rank whose own value came out NaN makes the mean NaN everywhere).
        norm = self.pm.clip_grad_norm_(self.cfg.train.grad_clip)
        aux = torch.tensor(self.pm.aux_loss(), dtype=torch.float64, device=self.env.device)  # MoE balance
        totals = torch.stack([loss.double(), norm.double(), aux])
        dist.all_reduce(totals)
        loss_mean, grad_norm, aux_loss = (totals / self.env.world_size).tolist()
        verdict = self.guard.judge(self.step + 1, loss_mean, grad_norm) if self.guard else None
        if verdict is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return verdict
        lr = self.scheduler.get_last_lr()[0]
        with self.timer.section("optimizer"):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(loss_mean, grad_norm, lr, aux_loss)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self, progress: bool = True) -> dict[str, Any]:
        t = self.cfg.train
        out = Path(t.out_dir)
        main = self.env.is_main
        # A resumed run appends: steps redone after a restart appear again (the later record wins).
        writer = MetricsWriter(out / "metrics.jsonl", append=self.step > 0) if main else None
        display = ProgressDisplay(t.steps, self.step, t.log_every, enabled=main and progress)
        tokens_per_step = t.global_batch * self.cfg.data.seq_len
        step_times: list[float] = []
        rollback: dict[str, Any] | None = None
        start = time.perf_counter()
        try:
            while self.step < t.steps:
                t0 = time.perf_counter()
                result = self.train_step()
                if isinstance(result, Verdict):  # nothing was applied; restore, skip data, go on
                    self.timer.step_done()  # the rejected step's timings belong to no step
                    self.step, rollback = self.guard.recover(result), self.guard.rollbacks[-1]
                    continue
                if self.ckpt is not None:  # after the optimizer step; the copy overlaps the next step
                    self.ckpt.save(self.step, self.state, persist=True if self.step == t.steps else None)
                dt = time.perf_counter() - t0
                sections = self.timer.step_done()
                stalwart.report(self.step, loss=result.loss, compute_s=sections["compute_s"])  # to the agent
                step_times.append(dt)
                tps = tokens_per_step / dt
                mfu = (self.flops_per_token * tps / (t.peak_flops * self.env.world_size)
                       if t.peak_flops else None)
                record = {"step": self.step, "loss": result.loss, "grad_norm": result.grad_norm,
                          "lr": result.lr, "tokens_per_s": tps, "step_time_s": dt, "mfu": mfu,
                          "samples_consumed": self.sampler.consumed, "time": time.time()}
                if self.pm.has_moe:
                    record["aux_loss"] = result.aux_loss
                if rollback is not None:  # on the first step after it (every record stays a step record)
                    record["rollback"], rollback = rollback, None
                if writer:
                    writer.write(record)
                display.update(record)
                self._chaos()  # after the step is logged: a fault "after step S" leaves S in the log
            stalwart.finished()  # teardown below (final persist, hashes) is not a hang
            if self.ckpt is not None:
                self.ckpt.wait(persist=True)  # the final state is durable before we report success
        except BaseException:
            if self.ckpt is not None:
                self.ckpt.close(success=False)  # snapshots stay for a restart
            raise
        finally:
            display.close()
            if writer:
                writer.close()
        if self.ckpt is not None:
            self.ckpt.close(success=True)
        wall = time.perf_counter() - start
        final_hash = self.weights_hash()
        summary = {
            "steps": self.step, "world_size": self.env.world_size, "dp_mode": self.cfg.parallel.dp_mode,
            "layout": self.plan.summary(),
            "model": self.cfg.model.name, "n_params": self.n_params, "grad_accum": self.accum,
            "global_batch": t.global_batch, "seq_len": self.cfg.data.seq_len,
            "final_loss": result.loss if step_times else None,
            "median_step_time_s": statistics.median(step_times) if step_times else None,
            "tokens_per_s": tokens_per_step / statistics.median(step_times) if step_times else None,
            "wall_s": wall, "samples_consumed": self.sampler.consumed, "final_hash": final_hash,
            "optim_hash": self.optimizer_hash(), "metrics": str(out / "metrics.jsonl"),
        }
        if self.ckpt is not None:
            summary["checkpoint"] = self.checkpoint_report()
        if self.guard is not None:
            summary["guard"] = self.guard.report()
        if main:
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def weights_hash(self) -> str:
        """Hash of the full (unsharded, all pipeline stages) model weights; a collective."""
        return state_dict_hash(get_model_state_dict(self.model), group=self.pm.pp_group)

    def optimizer_hash(self) -> str | None:
        """Hash of the full optimizer state (None before the first step); a collective."""
        if not self.optimizer.state:
            return None
        return state_dict_hash(get_optimizer_state_dict(self.model, self.optimizer), group=self.pm.pp_group)

    def checkpoint_report(self) -> dict[str, Any]:
        info, w = self.ckpt.last_restore, self.ckpt.writer.stats
        return {"restored_from": info.source if info else "disabled", "restore_step": info.step if info else 0,
                "restore_s": info.seconds if info else 0.0, "restore_detail": info.detail if info else "",
                "restore_skipped": info.skipped if info else [], "snapshots": w["snapshots"],
                "snapshots_skipped": w["skipped"], "hook_wait_s": w["wait_s"], "save_call_s": self.ckpt.stats["save_s"],
                "persist_requests": self.ckpt.stats["persist_requests"], "dir": self.ckpt.storage.url}

    def _chaos(self) -> None:
        """STALWART_CHAOS faults at point "step" fire here, after this step's snapshot completed."""
        fault = chaos.due("step", step=self.step, rank=self.env.rank)
        if fault is not None:
            if self.ckpt is not None:
                self.ckpt.wait()
            fault.fire()
