"""The training loop: one class that owns model, optimizer, schedule, sampler and the step.

Everything that a checkpoint must capture is an attribute with ``state_dict``/``load_state_dict``
(model, optimizer, scheduler, sampler) plus ``step``; nothing else carries state between steps, which
is what makes bitwise resume possible.

The step has torchtitan's shape: ``train_step`` = data → ``forward_backward`` (micro-batches, or the
pipeline schedule) → clip → update, with chaos faults, the guard, snapshots and metrics attached as
hooks (``stalwart.train.hooks``). Loss and gradient norm stay device tensors: nothing on the step
path waits for the device unless a hook needs a value (the guard every step; metrics at log steps).
The model is built on the meta device and only this rank's shards are materialised
(``stalwart.train.parallel.materialize``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import stalwart
from stalwart import chaos, runtime
from stalwart._compat import set_deterministic_algorithms
from stalwart.config import Config
from stalwart.data import BatchLoader, GlobalSampler, TokenDataset, ensure_default_corpus
from stalwart.data.sampler import parse_skip_ranges
from stalwart.dist import DistEnv
from stalwart.models import build_model, count_params
from stalwart.observe import tensorboard
from stalwart.observe.flight import start_for_worker
from stalwart.observe.timers import SectionTimer, StageForwards
from stalwart.plan.compute import flops_per_token
from stalwart.train.compile import compile_blocks
from stalwart.train.guard import Verdict
from stalwart.train.hooks import ChaosLossHook, CheckpointHook, GuardHook, StepHook, StepStats
from stalwart.train.metrics import MetricsHook
from stalwart.train.optim import build_optimizer, build_scheduler
from stalwart.train.parallel import build_mesh, parallelize
from stalwart.train.parallel.mesh import Coords, tp_data_group
from stalwart.train.parallel.pipeline import lm_loss
from stalwart.train.resolve import rank0_plan, resolve
from stalwart.train.summary import write_summary
from stalwart.utils import state_dict_hash
from stalwart.utils.phases import Phases


def configure_determinism(cfg: Config, env: DistEnv) -> None:
    t = cfg.train
    threads = t.threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    torch.set_num_threads(threads)
    random.seed(t.seed + env.rank)
    np.random.seed(t.seed + env.rank)
    torch.manual_seed(t.seed + env.rank)
    if t.deterministic:
        if t.compile:  # inductor's own determinism flag is set only once inductor is imported
            importlib.import_module("torch._inductor.config")
        set_deterministic_algorithms()
        if env.device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False


def mesh_coords(c: Coords) -> dict[str, int]:
    """The rank's coordinates for its records and its track in the merged timeline."""
    return {"dp": c.dp_rank, "pp": c.pp_rank, "tp": c.tp_rank}


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, phases: Phases | None = None) -> None:
        cfg.validate()  # field checks before any work; the layout is checked by resolve() below
        self.cfg, self.env, self.phases = cfg, env, phases or Phases()
        configure_determinism(cfg, env)
        if cfg.data.prepare_default and env.local_rank == 0:
            ensure_default_corpus(cfg.data.dir)
        dist.barrier()
        self.dataset = TokenDataset(cfg.data.dir, cfg.data.seq_len)
        self.plan = rank0_plan(resolve(cfg, env.world_size, self.dataset.vocab_size))  # the only planning
        self.model_args = self.plan.model_args
        if self.plan.why and env.is_main:
            print(self.plan.why, file=sys.stderr, flush=True)

        with torch.device("meta"):  # no memory: only this rank's shards are ever allocated
            model = build_model(cfg.model.name, self.model_args)
        self.n_params = count_params(model)
        # DDP, FSDP2, TP, PP, EP, recompute, then this rank's shards materialised, each parameter drawn
        # from (train.seed, its name): the same weights whatever the world size or layout. self.model is
        # this rank's part under the unsplit model's parameter names (what the optimizer and checkpoints
        # see); self.pm holds the pieces the step is made of.
        self.pm = parallelize(
            model,
            self.plan.layout,
            build_mesh(self.plan.layout, env.device.type),
            self.plan.options,
            env.device,
            init_seed=cfg.train.seed,
        )
        self.model = self.pm.module
        self.phases.mark("plan_and_build")  # the plan, the model's shards materialised on the device
        self.compiled_blocks = compile_blocks(self.pm.parts) if cfg.train.compile else 0
        self.accum = self.plan.grad_accum
        self.optimizer = build_optimizer(self.model, cfg.train, cfg.optim.name)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.sampler = GlobalSampler(
            len(self.dataset),
            cfg.train.global_batch,
            cfg.data.seed,
            cfg.data.shuffle,
            parse_skip_ranges(cfg.data.skip_samples),
        )
        share, share_src = tp_data_group(self.pm.mesh)  # TP ranks read one batch: the first reads, all get it
        self.loader = BatchLoader(
            self.dataset,
            self.sampler,
            self.pm.dp_rank,
            self.pm.dp_size,
            cfg.data.prefetch,
            self.pm.device,
            share,
            share_src,
        )
        self.step = 0
        self.timer = SectionTimer(env.device)
        pipe = self.pm.pipeline  # per-micro-batch stage forwards: the timeline's send → recv arrows
        self.stage_forwards = StageForwards(self.timer, pipe.modules, pipe.ids) if pipe is not None else None
        self._forward_fault: Any = None  # chaos at point "forward" for the step under way
        self._begun_n = 0  # micro-batches per step the MoE loss weight was last set for
        self._has_moe = self.pm.has_moe
        self._zero_aux = torch.zeros((), dtype=torch.float32, device=self.pm.device)
        self.flops_per_token = flops_per_token(
            self.n_params,
            self.model_args.n_layers,
            self.model_args.dim,
            cfg.data.seq_len,
            window=self.model_args.attn_window,
        )
        # Everything a resume needs besides `step` (which restore returns).
        self.state = {
            "model": self.model,
            "optim": self.optimizer,
            "scheduler": self.scheduler,
            "sampler": self.sampler,
        }
        t = cfg.train
        self.metrics = MetricsHook(
            Path(t.out_dir),
            t.steps,
            t.log_every,
            t.global_batch * cfg.data.seq_len,
            env.world_size,
            self.flops_per_token,
            t.peak_flops,
            env.is_main,
            moe=self.pm.has_moe,
            rank=env.rank if t.rank_records else None,
            coords=mesh_coords(self.pm.coords),
            tensorboard=tensorboard.wanted(t.tensorboard),
        )
        self.ckpt = self._build_checkpointer()
        if self.ckpt is not None:  # a snapshot carries its step's record (MetricsHook.stage)
            self.state["metrics"] = self.metrics
        self.guard: Any = None  # stalwart.train.rollback.TrainingGuard when guard.enabled
        if cfg.guard.enabled:  # validate() made sure checkpoints are on
            from stalwart.train.rollback import TrainingGuard

            self.guard = TrainingGuard(cfg.guard, self.ckpt, self.state, self.sampler, env.device)
            self.state["guard"] = self.guard.detector  # its baseline rolls back with the weights
        self.phases.mark("optimizer_data_checkpointer")
        if self.ckpt is not None:  # resume=false is about earlier runs: a restart of this launch resumes
            resume = cfg.checkpoint.resume or runtime.worker_env().restart_count > 0
            self.step = self.ckpt.restore(self.state) if resume else self.ckpt.discard_snapshots()
        self.phases.mark("restore")
        runtime.set_section_timer(self.timer)  # stalwart.timer("name") sections join this rank's records
        # Under `stalwart run`: answers the agent's Flight Recorder requests on a hang (observe.flight).
        groups = {dim: self.pm.mesh[dim].get_group() for dim in ("dp", "pp", "tp")}
        self.flight = start_for_worker(groups, mesh_coords(self.pm.coords)) if t.flight_dumps else None
        self.hooks: list[StepHook] = [ChaosLossHook(env.rank)]
        if self.guard is not None:
            self.hooks.append(GuardHook(self.guard, env.world_size))
        if self.ckpt is not None:
            self.hooks.append(CheckpointHook(self.ckpt, t.steps))
        self.hooks.append(self.metrics)  # last: its step time includes the snapshot's start

    def _build_checkpointer(self) -> Any:
        c, out = self.cfg.checkpoint, Path(self.cfg.train.out_dir)
        if not c.enabled:
            return None
        from stalwart.checkpoint import Checkpointer
        from stalwart.checkpoint.storage_health import AtRiskPolicy

        out.mkdir(parents=True, exist_ok=True)
        persists = bool(c.persist_every_steps or c.persist_every_s)  # memory-only needs no keeper (multi-node)
        return Checkpointer(
            c.dir or str(out / "checkpoints"),
            memory_every=c.memory_every,
            persist_every_steps=c.persist_every_steps,
            persist_every_s=c.persist_every_s,
            keep_last=c.keep_last,
            keep_every=c.keep_every,
            shm_root=c.shm_dir or None,
            keeper_idle_s=c.keeper_idle_s,
            keep_shm_s=c.keep_shm_s,
            keeper_log=out / "keeper.log",
            keeper=persists,
            at_risk=AtRiskPolicy(c.max_unpersisted_steps, c.max_unpersisted_s),
        )

    # -- one optimizer step --------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.cfg.train.dtype
        if dtype == "bfloat16" or (dtype == "auto" and self.env.device.type == "cuda"):
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over this dp rank's share of the global batch, as micro-batches or the
        pipeline schedule; gradients end up as the mean over the global batch. Returns this dp rank's
        mean loss (a device tensor; ``train_step`` averages it over the dp ranks asynchronously)."""
        pm = self.pm
        inputs, targets = inputs.to(pm.device), targets.to(pm.device)
        n = pm.micro_batches(inputs.shape[0])
        if n != self._begun_n:  # the MoE loss weight is a module attribute: set once per n (a module walk)
            pm.begin_step(n)
            self._begun_n = n
        if pm.pipeline is not None:  # forward, backward and P2P waits interleave: one compute section
            with self.timer.section("pipeline"), self.autocast(), self._chaos_at_forward():
                loss = pm.pipeline.step(inputs, targets, n, self._on_loss)
            self.stage_forwards.flush(n)
            return loss
        total = torch.zeros((), dtype=torch.float32, device=pm.device)
        mb = pm.options.micro_batch
        for i, (x, y) in enumerate(zip(inputs.split(mb), targets.split(mb))):
            with pm.micro_batch(last=i == n - 1):
                with self.timer.section("forward"), self.autocast(), self._chaos_at_forward():
                    loss = self._on_loss(lm_loss(pm.parts[0](x), y) / n)
                with self.timer.section("backward", compute=False):  # waits on gradient reduction
                    loss.backward()
            total += pm.local_value(loss)
        return total

    def train_step(self) -> StepStats | Verdict:
        """One optimizer step on the next global batch — unless a hook (the guard) judges it bad: then
        its gradients are dropped, nothing is applied and the verdict returned. No host sync unless a
        hook asks for one (the guard, log steps)."""
        step = self.step + 1
        for hook in self.hooks:
            hook.before_step(self, step)
        self._forward_fault = chaos.due("forward", step=step, rank=self.env.rank)
        if not self.pm.parts[0].training:  # nothing on the step path sets eval; a walk only if something did
            self.pm.train()
        with self.timer.section("data"):
            inputs, targets = self.loader.next()  # read ahead in the background (data.prefetch)
        loss, loss_reduce = self.pm.sum_over_dp_async(self.forward_backward(inputs, targets))
        with self.timer.section("grad_clip", compute=False):  # the norm's all-reduce
            grad_norm = self.pm.clip_grad_norm_(self.cfg.train.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        stats = StepStats(step, loss, grad_norm, self._aux_loss(), lr, loss_reduce=loss_reduce, dp_size=self.pm.dp_size)
        for hook in self.hooks:
            verdict = hook.after_backward(self, stats)
            if verdict is not None:
                stats.settle()  # no collective left in flight
                self.optimizer.zero_grad(set_to_none=True)
                return verdict
        with self.timer.section("optimizer"):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        stats.settle()
        if self.ckpt is not None:
            self.metrics.stage(self, stats)  # before the snapshot: it carries the step's record
        try:
            for hook in self.hooks:
                hook.after_step(self, stats)
        except BaseException:  # e.g. the checkpoint call when a peer died: a restart may resume past it
            with contextlib.suppress(Exception):  # the first failure is the one to report
                self.metrics.keep_applied(self, stats)
            raise
        return stats

    @contextlib.contextmanager
    def _chaos_at_forward(self) -> Any:
        """STALWART_CHAOS ``at=forward``, inside the forward (or pipeline) section, at exactly (step,
        rank): ``delay:seconds=S`` stalls the step's first forward; ``slow:factor=F`` makes every
        forward of the step F× as long (a slow-compute straggler); other faults fire before it."""
        fault = self._forward_fault
        if fault is None or not fault.stretches:
            self._forward_fault = None
            if fault is not None:
                fault.fire()
            yield
            return
        t0 = time.perf_counter()
        yield
        fault.stretch(time.perf_counter() - t0)

    def _on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        for hook in self.hooks:
            loss = hook.on_loss(loss)
        return loss

    def _aux_loss(self) -> torch.Tensor:
        """The MoE load-balancing loss averaged over all ranks (one all-reduce, MoE models only)."""
        if not self._has_moe:  # dense: no module walk per step, a constant 0
            return self._zero_aux
        aux = self.pm.aux_loss()
        if self.env.world_size > 1:
            dist.all_reduce(aux)
            aux = aux / self.env.world_size
        return aux

    # -- the loop ------------------------------------------------------------------------------
    def fit(self, progress: bool = True) -> dict[str, Any]:
        t = self.cfg.train
        self.metrics.open(self.step, progress)
        start = time.perf_counter()
        try:
            while self.step < t.steps:
                result = self.train_step()
                if "first_step" not in self.phases.seconds:
                    self.phases.mark("first_step")
                if isinstance(result, Verdict):  # nothing was applied; restore, skip data, go on
                    self.timer.discard()  # the rejected step's timings belong to no step
                    self.step = self.guard.recover(result)
                    self.metrics.note_rollback(self.guard.rollbacks[-1])
                    continue
                self.chaos_point()  # after the step is logged: a fault "after step S" leaves S in the log
            self.metrics.drain(wait=True)
            stalwart.finished()  # teardown below (final persist, hashes) is not a hang
            if self.ckpt is not None:
                self.ckpt.ensure_durable(self.step)  # the final state is durable before we report success
            self.loader.close()  # the reads already submitted (they pair up across a TP group)
        except BaseException:
            self.loader.close(timeout=1.0)  # a peer may be gone: a daemon thread, not waited for long
            if self.ckpt is not None:
                self.ckpt.close(success=False)  # snapshots stay for a restart
            raise
        finally:
            self.metrics.drain()  # after a failure too: the records whose values already reached the host
            self.metrics.close()
        if self.ckpt is not None:
            self.ckpt.close(success=True)
        return write_summary(self, time.perf_counter() - start)

    def weights_hash(self) -> str:
        """Hash of the full (unsharded, all pipeline stages) model weights; a collective."""
        return state_dict_hash(get_model_state_dict(self.model), group=self.pm.pp_group)

    def optimizer_hash(self) -> str | None:
        """Hash of the full optimizer state (None before the first step); a collective."""
        if not self.optimizer.state:
            return None
        return state_dict_hash(get_optimizer_state_dict(self.model, self.optimizer), group=self.pm.pp_group)

    def chaos_point(self, point: str = "step") -> None:
        """STALWART_CHAOS faults at point "step" fire here once the step is logged, at "saved" right after
        its checkpoint call (its record not yet written): one that ends the process once this node's
        snapshots of the step are whole (up to 10 s; a peer's copy may trail ours, and "kill after step
        S" must leave S, not S - 1), others once this rank's is."""
        fault = chaos.due(point, step=self.step, rank=self.env.rank)
        if fault is not None:
            if point == "step":
                self.metrics.drain(wait=True)
            if self.ckpt is not None and not fault.ends_process:
                self.ckpt.wait()
            elif self.ckpt is not None and not self.ckpt.wait_node_holds(self.step):
                print(f"stalwart chaos: step {self.step}: a snapshot of this node is not whole", file=sys.stderr)
            fault.fire()
