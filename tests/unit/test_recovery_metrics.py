"""The one definition of MTTR, regain, lost steps and goodput (stalwart demo and benchmarks/recovery.py)."""

from __future__ import annotations

import pytest

from stalwart.demo.recovery_metrics import StepRecord, final_trajectory, goodput, recovery, split_at

# Steps 1..5 done at t=1..5; the fault at t=5.5 after step 5; the restart resumes from the step-3
# checkpoint and redoes 4, 5 at t=9, 10, then 6 at t=11. Every step's work is 0.5 s, 0.1 s of it in
# the checkpoint call.
LOG = [
    StepRecord(s, t, 0.5, 0.1)
    for s, t in [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (4, 9.0), (5, 10.0), (6, 11.0)]
]


def test_recovery_figures_of_one_fault():
    before, after = split_at(LOG, 5.5)
    figures = recovery(before, after, fault_time=5.5)
    assert (figures.last_step, figures.resumed_step, figures.lost_steps) == (5, 3, 2)
    assert figures.mttr_s == pytest.approx(3.5)  # first step after the restart (4) at t=9
    assert figures.regain_s == pytest.approx(5.5)  # first step past 5 (6) at t=11


def test_known_resume_step_and_last_step_win_over_the_log():
    before, after = split_at(LOG, 5.5)
    figures = recovery(before[:3], after, fault_time=5.5, last_step=5, resumed_step=2)
    assert (figures.last_step, figures.resumed_step, figures.lost_steps) == (5, 2, 3)


def test_a_job_that_never_restarted_has_no_recovery():
    figures = recovery(LOG[:5], [], fault_time=5.5)
    assert (figures.last_step, figures.mttr_s, figures.regain_s, figures.lost_steps) == (5, None, None, None)


def test_goodput_counts_each_step_once_without_checkpoint_calls():
    assert sorted(final_trajectory(LOG)) == [1, 2, 3, 4, 5, 6]
    assert final_trajectory(LOG)[4].time == 9.0  # a redone step's later completion wins
    assert goodput(LOG, wall_s=12.0) == pytest.approx(6 * 0.4 / 12.0)
    assert goodput(LOG, wall_s=0.0) is None
