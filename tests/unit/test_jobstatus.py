"""`stalwart status`'s view from synthetic master status and records."""

from __future__ import annotations

import time

from stalwart.observe.jobstatus import build_status


def _records(steps: int, rank: int) -> list[dict]:
    now = time.time()
    return [
        {"step": s, "rank": rank, "time": now - steps + s, "tokens_per_s": 100.0 * s, "mfu": None, "loss": 5.0 / s}
        | {"ms": {"step": 10.0}}
        for s in range(1, steps + 1)
    ]


def test_an_open_hang_is_recovering_with_its_diagnosis():
    hang = {"id": 2, "kind": "hang", "node_id": "n0", "fault": 10.0, "detected": 14.0, "first_step": None}
    hang["details"] = {"collectives": {"summary": "group dp ... rank 3 [dp1 pp1] never entered"}}
    old = {"id": 1, "kind": "sigkill", "node_id": "n0", "fault": 1.0, "detected": 1.5, "first_step": 4.0, "details": {}}
    master = {"job_id": "j", "incidents": [old, hang], "nodes": [], "stragglers": ["n1"], "restarts_used": 1}
    status = build_status(master, True, _records(20, 0) + _records(18, 1), last_incidents=5)
    assert status["state"] == "recovering" and status["step"] == 20
    assert status["tokens_per_s"] == 1550.0, "median of the newest 10 steps of the lowest rank"
    assert status["ranks"][1]["step"] == 18
    assert [i["recover_s"] for i in status["incidents"]] == [3.0, None]
    assert status["incidents"][1]["detect_s"] == 4.0 and "rank 3" in status["diagnosis"]
    assert status["stragglers"] == ["n1"] and status["section_stragglers"] == {}


def test_a_finished_run_without_a_master():
    status = build_status(None, False, _records(3, 0), {"checkpoint": {"dir": "/c", "snapshots": 3}})
    assert status["state"] == "finished" and status["checkpoint"]["dir"] == "/c" and "incidents" not in status


def test_without_records_the_masters_live_section_stragglers_are_shown():
    master = {"job_id": "j", "incidents": [], "nodes": [], "section_stragglers": {"1": ["forward"]}}
    assert build_status(master, True, [])["section_stragglers"] == {1: ["forward"]}
    slow = _records(30, 0) + [r | {"rank": 1, "ms": {"forward": 50.0}} for r in _records(30, 0)]
    fast = [r | {"ms": {"forward": 20.0}} for r in slow if r["rank"] == 0]
    ranks = fast + [r for r in slow if r["rank"] == 1]
    master["section_stragglers"] = {"0": ["data"]}  # the master's view is older than the records
    assert build_status(master, True, ranks)["section_stragglers"] == {1: ["forward"]}, "the records win"
    assert build_status(master, True, ranks, stages={0: 0, 1: 1})["section_stragglers"] == {}, "no peer"
