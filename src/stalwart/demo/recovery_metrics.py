"""How well a job recovers from a fault: the one definition of each figure, for `stalwart demo` and
``benchmarks/recovery.py`` alike.

Both read the job's own per-step log (``StepRecord``: which step completed, when, and how long its
work took; the demo from the trainer's ``metrics.jsonl``, the benchmark from its job's rank-0 log).
Training is synchronous, so a step logged by one rank is a step completed by every rank. Times are
wall clock (``time.time()``).

* **fault time**: when the fault began, stamped by the faulted process itself just before it fires
  (``stalwart.runtime.fault_fired``; a hang: when the rank stopped reporting).
* **MTTR** (time to recover) = fault time → the first step completed after the restart.
* **regain** = fault time → the first completion of a step past the last step completed before the
  fault: the job is back where it was.
* **lost_steps** = the last step completed before the fault − the step the restart resumed from
  (the checkpoint's step): the steps computed twice.
* **goodput** = productive time ÷ wall time of the whole job (launcher start → exit, so start-up,
  detection, restarts, recomputation and teardown are all lost). Productive time is the work of the
  *final trajectory* — the last completion of each step, so a redone step counts once — without
  the blocking checkpoint call (``StepRecord.checkpoint_s``), which is overhead, not training.

Which completions belong to the restarted job ("after") is the caller's to say: the benchmark knows
each record's attempt; the demo takes those logged after the fault was detected (the restart always
follows the detection, and the surviving ranks are blocked in a collective until then).

Stdlib only, so a benchmark can import it without the demo's dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One completion of a step, as the job logged it."""

    step: int
    time: float  # wall clock when the step (and its checkpoint call) completed
    busy_s: float  # the step's own time, checkpoint call included if the job makes one inside it
    checkpoint_s: float = 0.0  # the blocking checkpoint call's part of busy_s

    @property
    def productive_s(self) -> float:
        return self.busy_s - self.checkpoint_s


@dataclass(frozen=True)
class Recovery:
    """The figures of one fault (see the module docstring); None where the job never got there."""

    last_step: int  # completed before the fault
    resumed_step: int | None  # the step the restart resumed from
    mttr_s: float | None
    regain_s: float | None
    lost_steps: int | None


def final_trajectory(records: Iterable[StepRecord]) -> dict[int, StepRecord]:
    """The last completion of each step (records in time order: a redone step's later record wins)."""
    return {r.step: r for r in records}


def goodput(records: Iterable[StepRecord], wall_s: float) -> float | None:
    """Productive time of the final trajectory ÷ the job's wall time; None without a wall time."""
    if wall_s <= 0:
        return None
    return sum(r.productive_s for r in final_trajectory(records).values()) / wall_s


def recovery(
    before: Sequence[StepRecord],
    after: Sequence[StepRecord],
    fault_time: float,
    last_step: int | None = None,
    resumed_step: int | None = None,
) -> Recovery:
    """The figures of one fault from the completions ``before`` it and ``after`` the restart (time order).

    ``last_step``: the last step completed before the fault when the caller knows it otherwise (the
    fault's own record, the agent's progress); the larger of it and the log's counts. ``resumed_step``:
    the restored checkpoint's step, if the job says; else the step before the first one after the
    restart.
    """
    last = max([r.step for r in before] + ([last_step] if last_step is not None else []), default=-1)
    if not after:
        return Recovery(last, resumed_step, None, None, None)
    resumed = after[0].step - 1 if resumed_step is None else resumed_step
    past = next((r for r in after if r.step > last), None)
    return Recovery(
        last_step=last,
        resumed_step=resumed,
        mttr_s=after[0].time - fault_time,
        regain_s=past.time - fault_time if past is not None else None,
        lost_steps=max(0, last - resumed),
    )


def split_at(records: Sequence[StepRecord], time: float) -> tuple[list[StepRecord], list[StepRecord]]:
    """(completions at or before ``time``, completions after it), each in time order."""
    return [r for r in records if r.time <= time], [r for r in records if r.time > time]
