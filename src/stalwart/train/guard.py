"""Training-health guard: NaN/Inf, loss spikes and gradient-norm spikes, judged before the update.

PaLM and Falcon fixed loss spikes by hand: roll back ~100 steps, skip a few hundred batches. The
detector here decides from the step's global loss and gradient norm, *before* the optimizer applies
the update, so a poisoned step never reaches the weights:
  - non-finite loss or gradient norm → "nan";
  - loss > median + k·MAD of the last `window` healthy steps → "loss_spike" (robust to the slow
    downward trend and to earlier spikes, which never enter the window);
  - gradient norm > median + k·MAD likewise → "grad_spike".
The first `warmup_steps` steps only feed the window: early training is legitimately erratic.

This module is the pure policy (no torch); :mod:`stalwart.train.rollback` acts on its verdicts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GuardSettings:
    window: int = 50
    warmup_steps: int = 20
    loss_k: float = 6.0
    grad_k: float = 10.0  # gradient norms are heavier-tailed than losses
    min_rel_mad: float = 0.01  # MAD floor as a fraction of the median: a flat window is not zero noise
    check_grad_norm: bool = True

    def __post_init__(self) -> None:
        if self.window < 5:
            raise ValueError(f"guard window must be ≥ 5 steps, got {self.window}")
        if self.loss_k <= 0 or self.grad_k <= 0:
            raise ValueError("guard thresholds loss_k and grad_k must be positive")


@dataclass(frozen=True)
class Verdict:
    kind: str  # nan | loss_spike | grad_spike
    step: int
    value: float
    threshold: float

    def describe(self) -> str:
        if self.kind == "nan":
            return f"non-finite {'loss' if math.isnan(self.threshold) else 'value'} at step {self.step}"
        return f"{self.kind} at step {self.step}: {self.value:.4g} > {self.threshold:.4g}"


def _mad_threshold(values: deque, k: float, min_rel: float) -> float:
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median + k * max(mad, min_rel * abs(median))


@dataclass
class SpikeDetector:
    settings: GuardSettings = field(default_factory=GuardSettings)
    _losses: deque = field(default_factory=deque)
    _norms: deque = field(default_factory=deque)
    seen: int = 0

    def check(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict | None:
        """Judge one step; healthy steps enter the window, unhealthy ones never do."""
        s = self.settings
        if not math.isfinite(loss):
            return Verdict("nan", step, loss, math.nan)
        if grad_norm is not None and not math.isfinite(grad_norm):
            return Verdict("nan", step, grad_norm, math.inf)
        if self.seen >= s.warmup_steps and len(self._losses) >= 5:
            limit = _mad_threshold(self._losses, s.loss_k, s.min_rel_mad)
            if loss > limit:
                return Verdict("loss_spike", step, loss, limit)
            if s.check_grad_norm and grad_norm is not None and len(self._norms) >= 5:
                limit = _mad_threshold(self._norms, s.grad_k, s.min_rel_mad)
                if grad_norm > limit:
                    return Verdict("grad_spike", step, grad_norm, limit)
        self._push(loss, grad_norm)
        return None

    def _push(self, loss: float, grad_norm: float | None) -> None:
        self.seen += 1
        self._losses.append(loss)
        if grad_norm is not None:
            self._norms.append(grad_norm)
        for window in (self._losses, self._norms):
            while len(window) > self.settings.window:
                window.popleft()

    # Checkpointed with the training state, so a rollback does not forget the baseline.
    def state_dict(self) -> dict[str, object]:
        return {"losses": list(self._losses), "norms": list(self._norms), "seen": self.seen}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._losses = deque(state["losses"])  # type: ignore[arg-type]
        self._norms = deque(state["norms"])  # type: ignore[arg-type]
        self.seen = int(state["seen"])  # type: ignore[arg-type]


class GuardStop(RuntimeError):
    """The guard stopped the run: retrying cannot help, a person must look (log rules: fatal)."""


class RollbackLimitExceeded(GuardStop):
    """Too many rollbacks in a window: the run needs a person (the message lists them)."""


class RollbackUnavailable(GuardStop):
    """A bad step but no checkpoint to roll back to (e.g. before the first snapshot)."""


class SilentDataCorruption(RuntimeError):
    """A rank computed a wrong matmul in the burn-in after a NaN: a hardware fault, not the run's."""


def describe_rollback(entry: dict[str, object]) -> str:
    skipped = entry.get("skipped_samples")
    if skipped is None:
        return f"step {entry['step']}: {entry['kind']} (not rolled back)"
    return (
        f"step {entry['step']}: {entry['kind']} → back to {entry['rolled_back_to']}, skipped samples "
        f"{skipped[0]}..{skipped[1]}"
    )  # type: ignore[index]


@dataclass
class RollbackBudget:
    """At most `max_rollbacks` within any `per_steps` steps; every rollback is remembered."""

    max_rollbacks: int = 3
    per_steps: int = 1000
    history: list[dict[str, object]] = field(default_factory=list)

    def check(self, verdict: Verdict) -> None:
        """Raise RollbackLimitExceeded (listing every rollback and this verdict) if one more rollback
        for ``verdict`` would exceed the budget; call it before rolling back."""
        recent = [h for h in self.history if verdict.step - int(h["step"]) < self.per_steps]  # type: ignore[arg-type]
        if len(recent) + 1 > self.max_rollbacks:
            pending = {"step": verdict.step, "kind": verdict.kind}
            lines = "\n".join("  " + describe_rollback(h) for h in [*self.history, pending])
            raise RollbackLimitExceeded(
                f"{len(recent) + 1} rollbacks within {self.per_steps} steps (limit {self.max_rollbacks}); "
                f"stopping for inspection:\n{lines}"
            )

    def spend(
        self, verdict: Verdict, rolled_back_to: int, skipped: tuple[int, int], **extra: object
    ) -> dict[str, object]:
        """Record a rollback (after :meth:`check`); returns its entry."""
        entry = {
            "step": verdict.step,
            "kind": verdict.kind,
            "value": verdict.value,
            "threshold": verdict.threshold,
            "rolled_back_to": rolled_back_to,
            "skipped_samples": list(skipped),
            **extra,
        }
        self.history.append(entry)
        return entry
