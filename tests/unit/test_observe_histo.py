"""Step/section histograms: ms buckets, cumulative over a rank's restarts, exported by the master."""

from __future__ import annotations

import json
import random
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stalwart.launch import recent_steps
from stalwart.launch.journal import Journal
from stalwart.launch.master_histograms import RANK_FAMILY, SectionHistogramCollector
from stalwart.launch.master_state import MasterState
from stalwart.observe import histo, stragglers
from stalwart.observe.records import RankRecords


def _write(rec: RankRecords, step: int, forward_ms: float) -> None:
    rec.add_values(step, {"time": float(step), "ms": {"step": forward_ms + 5.0}})
    rec.add_sections({"step": step, "forward": forward_ms / 1e3, "compute_s": forward_ms / 1e3, "wait_s": 0.0})


def test_counts_survive_a_restart_including_steps_after_the_last_publish(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(histo, "PUBLISH_S", 1e9)  # publish once (the first record), never again
    rec = RankRecords(tmp_path, 1, {}, hist_dir=tmp_path / "progress0")
    for step, ms in enumerate([3.0, 250.0, 4.0], 1):  # the 250 ms stall lands after the only publish
        _write(rec, step, ms)
    # killed: no close(); the agent wipes its progress dir on a restart
    again = RankRecords(tmp_path, 1, {}, append=True, hist_dir=tmp_path / "progress1")
    _write(again, 4, 6.0)
    again.close()
    body = json.loads(histo.hist_path(tmp_path / "progress1", 1).read_text())
    forward = body["sections"]["forward"]
    assert forward["count"] == 4 and sum(forward["counts"]) == 4
    le = dict(zip([*histo.BUCKETS_MS, "inf"], forward["counts"]))
    assert le[5] == 2 and le[10] == 1 and le[500] == 1, "the stall is in the (200, 500] ms bucket"
    assert body["slowest"][0]["step"] == 2 and body["slowest"][0]["section"] == "forward", "named across the restart"


def test_the_slowest_steps_are_kept_once_each_slowest_first():
    h = histo.SectionHistograms(0)
    times = {step: 10.0 + step for step in range(1, 21)} | {7: 400.0}
    for step, ms in times.items():
        h.add({"step": step, "ms": {"step": ms, "forward": ms - 8.0, "optimizer": 2.0}})
    h.add({"step": 20, "ms": {"step": 25.0, "forward": 20.0}})  # step 20 redone after a restart, faster
    assert [r["step"] for r in h.slowest] == [7, 20, 19, 18, 17] and len(h.slowest) == histo.SLOWEST
    assert h.slowest[0] == {"step": 7, "ms": 400.0, "section": "forward", "section_ms": 392.0}
    assert h.slowest[1]["ms"] == 30.0, "a redone step keeps its slower time, once"
    h.add({"step": 21, "ms": {"forward": 999.0}})  # no whole-step time: not ranked
    assert [r["step"] for r in h.slowest][:1] == [7]


def test_the_master_exports_per_rank_and_per_node_histograms():
    h = histo.SectionHistograms(3)
    for ms in (3.0, 250.0):
        h.add({"ms": {"forward": ms}})
    nodes = [{"node_id": "n0", "progress": {"hist": {"3": h.to_dict()}}}]
    registry = CollectorRegistry(auto_describe=False)
    incidents = [{"fault": 10.0, "detected": 10.5, "first_step": 16.0}, {"fault": 20.0, "detected": 21.5}]
    registry.register(SectionHistogramCollector(lambda: nodes, lambda: incidents))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    buckets = {
        s.labels["le"]: s.value
        for s in families[RANK_FAMILY].samples
        if s.name.endswith("_bucket") and s.labels["rank"] == "3" and s.labels["section"] == "forward"
    }
    assert buckets["5"] == 1 and buckets["200"] == 1 and buckets["500"] == 2 and buckets["+Inf"] == 2
    node = [s for s in families["stalwart_node_section_ms"].samples if s.name.endswith("_sum")]
    assert node[0].labels == {"node": "n0", "section": "forward"} and node[0].value == 253.0
    recovery = {
        s.labels["le"]: s.value for s in families["stalwart_incident_recovery_seconds"].samples if "le" in s.labels
    }
    assert recovery["5"] == 0 and recovery["10"] == 1 and recovery["+Inf"] == 1, "the open incident is not counted"
    detection = [s.value for s in families["stalwart_incident_detection_seconds"].samples if s.name.endswith("_sum")]
    assert detection == [2.0]


def test_the_master_flags_a_slow_section_live_from_the_heartbeats_histograms(tmp_path: Path, monkeypatch):
    """Two nodes × one rank write real records; their heartbeats carry the histogram files; rank 1's
    forward turns 1.3× slower at step 31 and the master's status names it by step 50, not before."""
    monkeypatch.setattr(recent_steps, "SCORES_S", 0.0)  # the test steps faster than the 2 s refresh
    state = MasterState(Journal(tmp_path / "journal.sqlite"), "job", restart_budget=1, node_timeout_s=30)
    writers = {r: RankRecords(tmp_path / f"run{r}", r, {"pp": 0}, hist_dir=tmp_path / f"progress{r}") for r in (0, 1)}
    for r in writers:
        state.join({"node_id": f"n{r}", "host": "h", "nproc": 1})
    rng = random.Random(0)
    flagged_at = []
    for step in range(1, 51):
        for r, rec in writers.items():
            forward = 80.0 * (1.3 if r == 1 and step > 30 else 1.0) * rng.uniform(0.95, 1.05)
            rec.add_values(step, {"time": float(step), "ms": {"step": forward + 40.0}})
            rec.add_sections({"step": step, "forward": forward / 1e3, "backward": 0.03, "compute_s": 0.1, "wait_s": 0})
            rec.hist.publish()
            body = {"node_id": f"n{r}", "progress": {"hist": histo.read_node(tmp_path / f"progress{r}")}}
            state.heartbeat(body)
        if state.status()["section_stragglers"]:
            flagged_at.append(step)
    assert flagged_at and flagged_at[0] <= 50 and flagged_at[0] > 40, flagged_at
    assert state.status()["section_stragglers"] == {1: ["forward"]}


def test_the_master_merges_beats_that_catch_the_ranks_a_publish_apart(tmp_path: Path, monkeypatch):
    """Each beat brings rank 1's newest steps one publish (10 steps) behind rank 0's: one beat's files
    share only 10 steps, too few for two windows; merged over beats they share them all."""
    monkeypatch.setattr(recent_steps, "SCORES_S", 0.0)
    state = MasterState(Journal(tmp_path / "journal.sqlite"), "job", restart_budget=1, node_timeout_s=30)
    for r in (0, 1):
        state.join({"node_id": f"n{r}", "host": "h", "nproc": 1})

    def hist(rank: int, last: int) -> dict:
        forward = 100.0 if rank == 1 else 50.0  # rank 1: twice as slow, from the start
        recent = [{"step": s, "ms": {"forward": forward}} for s in range(last - 19, last + 1)]
        return {str(rank): {"rank": rank, "stage": 0, "recent": recent}}

    flagged = []
    for last in range(30, 80, 10):
        state.heartbeat({"node_id": "n0", "progress": {"hist": hist(0, last)}})
        state.heartbeat({"node_id": "n1", "progress": {"hist": hist(1, last - 10)}})
        flagged.append(state.status()["section_stragglers"])
    assert flagged[0] == {} and flagged[1] == {1: ["forward"]}, flagged
    one_beat = [{"rank": r, "stage": 0, **h} for r, h in ((0, hist(0, 70)["0"]), (1, hist(1, 60)["1"]))]
    assert stragglers.live(one_beat)["flagged"] == {}, "a single beat's files are not enough"
