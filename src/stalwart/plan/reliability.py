"""Failures and checkpointing: odds of a failure, job MTBF, optimal checkpoint interval (Young 1974,
Daly 2006) and the expected effective-training-time ratio (ETTR) of a checkpoint policy.

Failures are modelled as independent and exponentially distributed (constant rates), as in Young's
and Daly's derivations; times are seconds unless a name says hours or days.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def _prob(name: str, p: float) -> None:
    if not 0 <= p < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {p}")


def p_any_failure(p_unit: float, n_units: int) -> float:
    """P(at least one of ``n_units`` fails) when each fails independently with probability
    ``p_unit`` over the same period: 1 - (1 - p)^N."""
    _prob("per-unit failure probability", p_unit)
    if n_units < 0:
        raise ValueError(f"the number of units must be >= 0, got {n_units}")
    return 1.0 - (1.0 - p_unit) ** n_units


def rate_from_probability(p: float, period_hours: float = 24.0) -> float:
    """Failures per hour of one unit that fails with probability ``p`` per ``period_hours``."""
    _prob("failure probability", p)
    return -math.log1p(-p) / period_hours


def job_mtbf_hours(
    n_gpus: int, *, p_gpu_day: float = 0.0, gpu_mtbf_hours: float = 0.0, n_nodes: int = 0, node_mtbf_hours: float = 0.0
) -> float:
    """Mean time between failures of the whole job: independent rates add up (per-GPU rate from a
    daily failure probability or an MTBF, plus an optional per-node rate)."""
    if n_gpus <= 0:
        raise ValueError(f"the number of GPUs must be positive, got {n_gpus}")
    rate = 0.0
    if p_gpu_day:
        rate += n_gpus * rate_from_probability(p_gpu_day)
    if gpu_mtbf_hours:
        if gpu_mtbf_hours <= 0:
            raise ValueError("GPU MTBF must be positive hours")
        rate += n_gpus / gpu_mtbf_hours
    if node_mtbf_hours:
        if node_mtbf_hours <= 0 or n_nodes <= 0:
            raise ValueError("node MTBF needs a positive number of nodes and hours")
        rate += n_nodes / node_mtbf_hours
    if rate <= 0:
        raise ValueError("give a failure rate: a per-GPU daily failure probability, a GPU MTBF or a node MTBF")
    return 1.0 / rate


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): compute time between checkpoints τ = sqrt(2·δ·M)."""
    _positive(checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher-order optimum: τ = sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ for
    δ < 2M, else τ = M."""
    _positive(checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def ettr(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected fraction of wall time that advances training, for compute interval τ between
    checkpoints costing δ each, restart cost R and exponential failures of mean M (Daly 2006):

        T_wall / T_solve = M·e^(R/M)·(e^((τ+δ)/M) − 1) / τ,   ETTR = its inverse.
    """
    _positive(interval_s=interval_s, mtbf_s=mtbf_s)
    if checkpoint_s < 0 or restart_s < 0:
        raise ValueError("checkpoint and restart costs must be >= 0 seconds")
    m = mtbf_s
    return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m))


def ettr_two_tier(
    fast_interval_s: float,
    fast_stall_s: float,
    fast_restart_s: float,
    slow_interval_s: float,
    slow_stall_s: float,
    slow_restart_s: float,
    mtbf_s: float,
    fast_recoverable: float,
) -> float:
    """First-order ETTR of in-memory snapshots every ``fast_interval_s`` backed by storage
    checkpoints every ``slow_interval_s``: a failure is recovered from memory with probability
    ``fast_recoverable`` (losing half a fast interval + its restart), otherwise from storage.
    ETTR ≈ (1 − stall overhead) × (1 − expected loss per failure / M)."""
    _positive(fast_interval_s=fast_interval_s, slow_interval_s=slow_interval_s, mtbf_s=mtbf_s)
    if not 0 <= fast_recoverable <= 1:
        raise ValueError(f"fraction of failures recoverable from memory must be in [0, 1], got {fast_recoverable}")
    stall = fast_stall_s / fast_interval_s + slow_stall_s / slow_interval_s
    loss = fast_recoverable * ((fast_interval_s + fast_stall_s) / 2 + fast_restart_s) + (1 - fast_recoverable) * (
        (slow_interval_s + slow_stall_s) / 2 + slow_restart_s
    )
    return max(0.0, (1 / (1 + stall)) * (1 - loss / mtbf_s))


@dataclass(frozen=True)
class Policy:
    """A checkpoint policy: storage checkpoints every ``interval_s`` stalling ``stall_s`` each and
    costing ``restart_s`` to resume; optionally memory snapshots in between (two tiers)."""

    name: str
    interval_s: float
    stall_s: float
    restart_s: float
    snapshot_interval_s: float = 0.0  # 0: no in-memory tier
    snapshot_stall_s: float = 0.0
    snapshot_restart_s: float = 0.0
    snapshot_recoverable: float = 0.0  # fraction of failures a memory snapshot survives

    def ettr(self, mtbf_s: float) -> float:
        if self.snapshot_interval_s:
            return ettr_two_tier(
                self.snapshot_interval_s,
                self.snapshot_stall_s,
                self.snapshot_restart_s,
                self.interval_s,
                self.stall_s,
                self.restart_s,
                mtbf_s,
                self.snapshot_recoverable,
            )
        return ettr(self.interval_s, self.stall_s, self.restart_s, mtbf_s)


def compare_policies(policies: list[Policy], mtbf_s: float, run_days: float) -> list[dict[str, float | str]]:
    """ETTR, expected failures and wall-clock days for each policy over a run needing ``run_days``
    of failure-free compute, best first."""
    if run_days <= 0:
        raise ValueError(f"run length must be positive days, got {run_days}")
    rows = []
    for pol in policies:
        e = pol.ettr(mtbf_s)
        wall_days = run_days / e if e > 0 else math.inf
        rows.append(
            {
                **asdict(pol),
                "ettr": e,
                "wall_days": wall_days,
                "expected_failures": wall_days * 86400 / mtbf_s,
                "lost_days": wall_days - run_days,
            }
        )
    return sorted(rows, key=lambda r: -float(r["ettr"]))


def _positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{key} must be positive, got {value}")
