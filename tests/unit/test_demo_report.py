"""The demo report's arithmetic on a hand-made journal: one entry per fault, lost steps, goodput."""

from __future__ import annotations

from stalwart.demo.job import JobResult
from stalwart.demo.report import lost_steps, recoveries, report, step_records


def incident(node: str, kind: str, fault: float | None, detected: float, first_step: float | None, **details) -> dict:
    return {
        "node_id": node,
        "kind": kind,
        "class": "system",
        "fault": fault,
        "detected": detected,
        "first_step": first_step,
        "details": details,
    }


# Rank 1 (node1) killed at t=10 after step 5; node0's rank 0 fails on the broken connection; both
# restart and resume at step 4 (2 steps lost). Then a hang: both nodes time out; resume from step 8.
INCIDENTS = [
    incident("node1", "sigkill", 10.0, 10.2, 15.0, ranks=[1], last_step=5),
    incident("node0", "connection", None, 10.5, 15.1, ranks=[0], last_step=5, consequential=True),
    incident("node0", "hang", 19.9, 30.0, 40.0, ranks=[0], last_step=8),
    incident("node1", "hang", 20.0, 30.1, 40.0, ranks=[1], last_step=8),
    incident("node0", "rollback", 35.0, 35.5, None, source="worker"),
]
METRICS = [
    {"step": s, "time": t, "step_time_s": 1.0}
    for s, t in [
        (1, 5.0),
        (2, 6.0),
        (3, 7.0),
        (4, 8.0),
        (5, 9.0),
        (4, 15.0),
        (5, 16.0),
        (6, 17.0),
        (7, 18.0),
        (8, 19.0),
        (9, 41.0),
        (10, 42.0),
    ]
]


def test_one_recovery_per_fault_with_the_cause_on_the_faulted_rank():
    kill, hang = recoveries(INCIDENTS, fault_rank=1)
    assert (kill["kind"], kill["node_id"], kill["fault"], kill["first_step"]) == ("sigkill", "node1", 10.0, 15.0)
    assert (hang["kind"], hang["node_id"], hang["fault"], hang["detected"]) == ("hang", "node1", 19.9, 30.0)


def test_lost_steps_count_the_recomputed_steps():
    assert lost_steps(METRICS, detected=10.2, last_step=5) == 2  # resumed at 4 after step 5
    assert lost_steps(METRICS, detected=30.0, last_step=8) == 0
    assert lost_steps(METRICS, detected=50.0, last_step=10) is None  # never resumed


def test_report_goodput_and_comparison():
    job = JobResult(
        [0, 0],
        50.0,
        INCIDENTS,
        2,
        {"steps": 10, "final_hash": "h", "checkpoint": {"hook_wait_s": 0.5, "save_call_s": 0.25}},
        METRICS,
    )
    result = report(job, [("kill", 5), ("hang", 8)], "h", True, fault_rank=1)
    assert [(i["injected"], i["kind"], i["lost_steps"]) for i in result["incidents"]] == [
        ("kill", "sigkill", 2),
        ("hang", "hang", 0),
    ]
    assert result["incidents"][0]["detected_s"] == 0.2 and result["incidents"][0]["mttr_s"] == 5.0
    assert result["incidents"][0]["regain_s"] == 7.0  # step 6 (past step 5) at t=17
    assert result["incidents"][1]["mttr_s"] == result["incidents"][1]["regain_s"] == 21.1  # step 9 at t=41
    assert result["goodput"] == 10 / 50  # 10 surviving steps of 1 s (redone steps 4, 5 count once)
    assert result["stall_s"] == 0.75 and result["bitwise_equal"] is True
    assert report(job, [], "other", False)["bitwise_equal"] is False
    # An incident nobody injected does not shift the attribution of the injected ones.
    spurious = [incident("node1", "hang", None, 1.0, 4.0, ranks=[1], last_step=0), *INCIDENTS]
    attributed = report(
        JobResult([0, 0], 50.0, spurious, 3, job.summary, METRICS), [("kill", 5), ("hang", 8)], "h", True, fault_rank=1
    )["incidents"]
    assert [(i["injected"], i["kind"]) for i in attributed] == [(None, "hang"), ("kill", "sigkill"), ("hang", "hang")]


def test_a_step_whose_checkpoint_call_failed_is_no_completion():
    # step 6's record written as its save failed at t=30 (the hang): not the first step after a restart
    interrupted = {"step": 6, "time": 30.0, "step_time_s": 11.0, "interrupted": True}
    assert step_records([*METRICS, interrupted]) == step_records(METRICS)
    assert [r.step for r in step_records(METRICS)] == [m["step"] for m in METRICS]
