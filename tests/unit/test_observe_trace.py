"""The merged timeline from synthetic records: clock offsets between hosts, track order, incidents."""

from __future__ import annotations

import pytest

from stalwart.observe.trace import build_trace, clock_offsets, track_name

PHASES = ("fault", "detected", "stopped", "restarted", "first_step")


def _records(skew: dict[int, float]) -> list[dict]:
    """Two steps on four ranks whose gradient all-reduce ends at the same true instant; rank r's
    clock is off by skew[r] seconds and its sections differ in length."""
    out = []
    for step in (1, 2):
        end = 100.0 + step  # true end of grad_clip
        for rank, off in skew.items():
            fwd = 10.0 + 5 * rank  # ms
            spans = [["data", 0.0, 1.0], ["forward", 1.0, fwd], ["grad_clip", 1.0 + fwd, 2.0]]
            start = end - (3.0 + fwd) / 1e3 + off
            out.append({"step": step, "rank": rank, "time": start, "spans": spans, "ms": {"step": 20.0 + fwd}})
    return out


META = {
    0: {"rank": 0, "host": "a", "coords": {"dp": 0, "pp": 0, "tp": 0}},
    1: {"rank": 1, "host": "a", "coords": {"dp": 1, "pp": 0, "tp": 0}},
    2: {"rank": 2, "host": "b", "coords": {"dp": 0, "pp": 1, "tp": 0}},
    3: {"rank": 3, "host": "b", "coords": {"dp": 1, "pp": 1, "tp": 0}},
}


def test_a_host_clock_offset_is_estimated_and_removed():
    records = _records({0: 0.0, 1: 0.0, 2: 0.05, 3: 0.05})  # host b runs 50 ms ahead
    assert clock_offsets(records, META) == pytest.approx({"a": 0.0, "b": 0.05})
    trace = build_trace(records, META)
    ends = {}
    for e in trace["traceEvents"]:
        if e["name"] == "grad_clip":
            ends.setdefault(e["pid"], []).append(e["ts"] + e["dur"])
    for pid in (2, 3, 4):  # the same collective ends at the same instant on every track
        assert ends[pid] == pytest.approx(ends[1], abs=1.0)
    assert trace["otherData"]["clock_offsets_ms"] == pytest.approx({"a": 0.0, "b": 50.0})


def test_tracks_are_named_by_coordinates_and_ordered_by_the_view():
    trace = build_trace(_records(dict.fromkeys(range(4), 0.0)), META, view="dp")
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["pid"] > 0]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert names[4] == "rank 3 [dp1 pp1 tp0]" and track_name(5, {}) == "rank 5"
    assert sorted(order, key=order.get) == [1, 3, 2, 4], "dp view: dp0 ranks (0, 2) first"
    with pytest.raises(ValueError, match="unknown view"):
        build_trace([], META, view="ep")


def test_incidents_decisions_and_rollbacks_are_job_events():
    incident = {"id": 1, "node_id": "n0", "kind": "sigkill", "class": "process", "details": {"rank": 0}}
    incident |= {"fault": 101.0, "detected": 101.5, "stopped": None, "restarted": 102.0, "first_step": 103.0}
    decision = {"ts": 101.6, "action": "restart", "reason": "worker died", "details": {}}
    trace = build_trace(_records({0: 0.0}), {0: META[0]}, [incident], [decision], [{"time": 104.0}], phases=PHASES)
    job = [e for e in trace["traceEvents"] if e["pid"] == 0 and e["ph"] != "M"]
    assert [e["name"] for e in job if e["cat"] == "incident"] == [
        "sigkill: fault",
        "sigkill: detected",
        "sigkill: restarted",
        "sigkill: first_step",
    ]
    [recovery] = [e for e in job if e["cat"] == "recovery"]
    assert recovery["dur"] == pytest.approx(2e6)
    assert {e["name"] for e in job} >= {"decision: restart", "rollback"}
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) == 0.0


def test_pipeline_forwards_are_joined_by_an_arrow_per_micro_batch_within_each_pipeline():
    """dp2 × pp2, two micro-batches: stage 0's forward of micro-batch k → stage 1's, in each pipeline
    (same dp coordinate), from inside the sender's span to inside the receiver's."""
    records = []
    for rank, m in META.items():
        stage = m["coords"]["pp"]
        spans = [["data", 0.0, 1.0]]
        spans += [[f"pp_fwd_s{stage}", 2.0 + 10 * k + 5 * stage, 4.0] for k in range(2)]
        spans += [["pipeline", 1.0, 40.0]]
        records.append({"step": 1, "rank": rank, "time": 100.0, "spans": spans, "ms": {"step": 45.0}})
    events = build_trace(records, META)["traceEvents"]
    flows = [e for e in events if e.get("cat") == "pp"]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert len(starts) == len(ends) == 4 and set(starts) == set(ends)
    spans = {(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("pp_fwd")}
    pairs = set()
    for i, s in starts.items():
        f = ends[i]
        src, dst = s["pid"] - 1, f["pid"] - 1
        assert META[src]["coords"]["pp"] == 0 and META[dst]["coords"]["pp"] == 1
        assert META[src]["coords"]["dp"] == META[dst]["coords"]["dp"], "an arrow stays within its pipeline"
        assert any(p == s["pid"] and a < s["ts"] < b for p, a, b in spans), "starts inside the sender's span"
        assert any(p == f["pid"] and a < f["ts"] < b for p, a, b in spans), "ends inside the receiver's span"
        assert f["bp"] == "e" and s["ts"] < f["ts"]
        pairs.add((src, dst, s["args"]["microbatch"]))
    assert pairs == {(0, 2, 0), (0, 2, 1), (1, 3, 0), (1, 3, 1)}
