"""Acting on the guard's verdicts: silent-corruption check, rollback, data skip (docs/guard.md).

    guard = TrainingGuard(cfg.guard, ckpt, state, sampler, device)
    state["guard"] = guard.detector              # the baseline rolls back with the weights
    ...                                          # forward/backward, global loss and grad norm
    verdict = guard.judge(step + 1, loss, grad_norm)   # before optimizer.step()
    if verdict:                                  # drop the gradients, apply nothing
        optimizer.zero_grad(); step = guard.recover(verdict)

``recover`` is collective and deterministic: every rank gets the same verdict from the same global
numbers, restores the same checkpoint and skips the same samples, so the run after a rollback equals
a run configured to skip those samples (``data.skip_samples``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from stalwart import chaos
from stalwart.config import GuardConfig
from stalwart.data.sampler import format_skip_ranges, merge_ranges
from stalwart.health.check import CheckConfig, burn_in
from stalwart.health.check import Fault as CheckFault
from stalwart.runtime import incident, phase
from stalwart.train.guard import (
    GuardSettings,
    RollbackBudget,
    RollbackLimitExceeded,
    RollbackUnavailable,
    SilentDataCorruption,
    SpikeDetector,
    Verdict,
)

log = logging.getLogger("stalwart.guard")
BURN_IN = CheckConfig(matmul_size=512, iters=3)  # well under a second; a wrong result shows at once


class TrainingGuard:
    """Detectors plus the rollback policy around a Checkpointer and a sampler with ``skip(n)``."""

    def __init__(
        self, cfg: GuardConfig, ckpt: Any, state: dict[str, Any], sampler: Any, device: torch.device, group: Any = None
    ) -> None:
        if ckpt is None:
            raise ValueError("the training guard needs a Checkpointer to roll back to (enable checkpoints)")
        self.cfg, self.ckpt, self.state, self.sampler = cfg, ckpt, state, sampler
        self.device, self.group = device, group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.detector = SpikeDetector(
            GuardSettings(
                window=cfg.window,
                warmup_steps=cfg.warmup_steps,
                loss_k=cfg.loss_k,
                grad_k=cfg.grad_k or 1.0,
                check_grad_norm=cfg.grad_k > 0,
            )
        )
        # Not checkpointed: a rollback must not forget itself (the budget counts across rollbacks).
        self.budget = RollbackBudget(cfg.max_rollbacks, cfg.per_steps)
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(f"[stalwart.guard rank {self.rank}] %(levelname)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False

    @property
    def rollbacks(self) -> list[dict[str, Any]]:
        return self.budget.history

    def judge(self, step: int, loss: float, grad_norm: float | None) -> Verdict | None:
        """The verdict on ``step`` from its global loss and gradient norm (same on every rank)."""
        return self.detector.check(step, loss, grad_norm)

    def recover(self, verdict: Verdict) -> int:
        """Handle a verdict: burn-in on NaN, budget, restore, skip. Returns the restored step (the
        caller continues after it). Raises SilentDataCorruption, RollbackLimitExceeded or
        RollbackUnavailable, each after journaling the incident."""
        with phase("checkpoint"):  # a restore from storage may take a while: not a hang
            return self._recover(verdict)

    def _recover(self, verdict: Verdict) -> int:
        if self.rank == 0:
            log.warning("%s: the update was not applied", verdict.describe())
        if verdict.kind == "nan" and self.cfg.sdc_check:
            self._burn_in(verdict)
        try:
            self.budget.check(verdict)
        except RollbackLimitExceeded as err:
            self._incident("rollback_limit", verdict.step, report=str(err), rollbacks=self.rollbacks)
            raise
        target = verdict.step - self.cfg.rollback_steps
        try:
            info = self.ckpt.rollback(self.state, at_most=target, before=verdict.step)
        except LookupError as err:
            self._incident("rollback_unavailable", verdict.step, report=str(err), rollbacks=self.rollbacks)
            raise RollbackUnavailable(f"{verdict.describe()}: cannot roll back: {err}") from None
        skipped = self.sampler.skip(self.cfg.skip_batches)
        entry = self.budget.spend(verdict, info.step, skipped, source=info.source)
        if info.step > target:
            entry["short"] = True  # no checkpoint was old enough yet (early in the run)
        self._incident(
            "rollback",
            verdict.step,
            verdict=verdict.kind,
            **{k: v for k, v in entry.items() if k not in ("step", "kind")},
        )
        if self.rank == 0:
            log.warning(
                "rolled back to step %d (%s: %s), skipping samples %d..%d",
                info.step,
                info.source,
                info.detail,
                *skipped,
            )
        return info.step

    def _burn_in(self, verdict: Verdict) -> None:
        """Silent data corruption check (stalwart.health.check's burn-in) on every rank. Chaos
        ``nan:rank=R:at=matmul`` makes rank R compute a wrong result."""
        fault = chaos.due("matmul", step=verdict.step, rank=self.rank)
        cfg = (
            BURN_IN
            if fault is None
            else CheckConfig(matmul_size=BURN_IN.matmul_size, iters=BURN_IN.iters, fault=CheckFault("nan", self.rank))
        )
        ok, _ = burn_in(cfg, self.device, self.rank)
        flags = torch.zeros(self.world, device=self.device)
        flags[self.rank] = float(not ok)
        if dist.is_initialized():
            dist.all_reduce(flags, group=self.group)
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if not bad:
            if self.rank == 0:
                log.info(
                    "matmul burn-in correct on all %d ranks: treating step %d as a training incident",
                    self.world,
                    verdict.step,
                )
            return
        if self.rank in bad:  # journaled by the bad rank itself, through its own node's agent
            incident(
                "sdc",
                "hardware",
                step=verdict.step,
                evict=True,
                rank=self.rank,
                reason="matmul burn-in differs from the float64 reference after a non-finite loss",
            )
        raise SilentDataCorruption(
            f"{verdict.describe()}; rank(s) {bad} failed the matmul burn-in (wrong result vs a float64 "
            "reference): a hardware fault — evict their node(s); the update was not applied"
        )

    def _incident(self, kind: str, step: int, **detail: Any) -> None:
        if self.rank == 0:  # one journal entry per job-wide event
            incident(kind, "training", step=step, **detail)

    def report(self) -> dict[str, Any]:
        """For summary.json: the rollbacks and the data.skip_samples value that reproduces the run."""
        ranges = [*getattr(self.sampler, "skip_ranges", []), *(e["skipped_samples"] for e in self.rollbacks)]
        return {"rollbacks": self.rollbacks, "skip_samples": format_skip_ranges(merge_ranges(ranges))}
