"""The master's live autoscaler: the step-time model, the recommendation and its hysteresis, and the
master acting on it (journal, eviction, status, /metrics)."""

from __future__ import annotations

import time

import pytest

from stalwart.launch.autoscale import AutoscalePolicy, Autoscaler, predict, ring
from stalwart.launch.journal import Journal
from stalwart.launch.master_metrics import JournalCollector
from stalwart.launch.master_state import MasterState


def test_the_model_drops_a_throttled_node_and_shrinks_a_communication_bound_job():
    # node d computes 3× slower; the others wait for it: step = 0.3 compute + 0.05 comm
    predicted = predict({"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.3}, 0.35, [2, 3, 4])
    assert predicted[3][1] == ["a", "b", "c"], "the best 3 are the fastest"
    assert predicted[3][0] == pytest.approx(0.1 * 4 / 3 + 0.05 * ring(3) / ring(4))
    assert predicted[3][0] < predicted[4][0] and predicted[3][0] < predicted[2][0]
    # compute 0.1, communication 1.0: fewer nodes shrink the all-reduce's bandwidth term
    comm_bound = predict({"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.1}, 1.1, [1, 2, 3, 4])
    assert min(comm_bound, key=lambda k: comm_bound[k][0]) == 1
    assert comm_bound[1][0] == pytest.approx(0.4), "one node: no all-reduce at all"


def windows(scaler: Autoscaler, compute: dict[str, float], step_s: float, now: float) -> None:
    for node, c in compute.items():
        scaler.observe(node, c, step_s, now)


def test_recommendation_waits_for_every_member_and_counts_windows_not_beats():
    scaler = Autoscaler(AutoscalePolicy(mode="recommend"))
    members = ["a", "b", "c", "d"]
    scaler.observe("a", 0.1, 0.35, 100.0)
    assert scaler.recommend(members, 2, 4, now=100.0) is None, "b, c, d have no window yet"
    windows(scaler, {"b": 0.1, "c": 0.1, "d": 0.3}, 0.35, 100.0)
    rec = scaler.recommend(members, 2, 4, now=100.0)
    assert rec is not None and (rec.current, rec.best, rec.keep) == (4, 3, ["a", "b", "c"])
    assert rec.gain == pytest.approx(rec.step_s[4] / rec.step_s[3] - 1) and rec.gain > 0.5
    assert rec.extrapolated == [2, 3], "only 4 nodes were ever observed"
    assert scaler.recommend(members, 2, 4, now=100.0) is None, "no new windows since"
    assert scaler.action(rec, members, now=100.0) is None, "mode recommend never acts"
    balanced = Autoscaler()
    windows(balanced, {"a": 1.0, "b": 1.0}, 1.1, 0.0)
    assert balanced.recommend(["a", "b"], 1, 2, now=0.0).best == 2, "balanced and compute-bound: stay"
    windows(balanced, {"a": 1.0, "b": 1.0}, 1.1, 0.0)
    grow = balanced.recommend(["a", "b"], 1, 3, spares=["c"], now=0.0)
    assert grow.best == 3 and grow.keep == ["a", "b", "c"] and grow.extrapolated == [1, 3], "a spare below MAX: grow"
    with pytest.raises(ValueError, match="--autoscale must be one of"):
        AutoscalePolicy(mode="auto")


def test_acting_needs_a_confirmed_recommendation_a_payback_and_a_cooldown():
    # smooth=1: each window judged alone (smoothing has its own test below)
    policy = AutoscalePolicy(mode="on", restart_cost_s=5.0, horizon_s=60.0, cooldown_s=100.0, confirm=2, smooth=1)
    scaler = Autoscaler(policy)
    slow = {"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.3}
    windows(scaler, slow, 0.35, 0.0)
    first = scaler.recommend(list(slow), 2, 4, now=0.0)
    assert scaler.action(first, list(slow), now=0.0) is None, "one window is not a trend"
    windows(scaler, slow, 0.35, 1.0)
    second = scaler.recommend(list(slow), 2, 4, now=1.0)
    kind, node, details = scaler.action(second, list(slow), now=1.0)
    assert (kind, node) == ("park", "d") and details["cause"] == "autoscale" and details["best"] == 3
    assert details["saving_s"] == pytest.approx(60.0 * (1 - second.step_s[3] / second.step_s[4]))
    for t in (2.0, 3.0):  # the same numbers again, within the cooldown
        windows(scaler, slow, 0.35, t)
        assert scaler.action(scaler.recommend(list(slow), 2, 4, now=t), list(slow), now=t) is None
    # a member restarting is briefly no member: a grow never "unparks" it, only a node that was parked
    grow = Autoscaler(AutoscalePolicy(mode="on", restart_cost_s=0.0, horizon_s=60.0, confirm=1, smooth=1))
    windows(grow, {"a": 0.1, "b": 0.1}, 0.15, 0.0)
    rec = grow.recommend(["a"], 1, 2, spares=["b"], now=0.0)
    assert rec is not None and rec.best == 2 and grow.action(rec, ["a"], now=0.0) is None
    assert grow.action(rec, ["a"], now=0.0, parked=["b"])[:2] == ("unpark", "b")
    costly = Autoscaler(AutoscalePolicy(mode="on", restart_cost_s=1000.0, horizon_s=60.0, confirm=1, smooth=1))
    windows(costly, slow, 0.35, 0.0)
    assert costly.action(costly.recommend(list(slow), 2, 4, now=0.0), list(slow), now=0.0) is None, "never pays back"


def test_the_master_parks_the_slowest_and_unparks_it_when_it_would_help(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    clock = [1e9]  # every node beats once a second, each round of beats a second later
    monkeypatch.setattr(time, "time", lambda: clock[0])

    def beat(state: MasterState, node: str, compute_s: float, step_s: float) -> dict:
        clock[0] += 1.0 / 3
        return state.heartbeat(
            {
                "node_id": node,
                "progress": {"member": True, "window": {"compute_s": compute_s, "steps": 5, "step_s": step_s}},
            }
        )

    policy = AutoscalePolicy(mode="on", restart_cost_s=1.0, horizon_s=600.0, cooldown_s=0.0, confirm=2)
    state = MasterState(Journal(tmp_path / "j.sqlite"), "job", 3, 30.0, autoscaler=Autoscaler(policy))
    for n in ("a", "b", "c"):
        state.join({"node_id": n, "host": "h", "nproc": 1, "info": {"min_nodes": 2, "max_nodes": 3}})
    # The first round has only a as a member yet (b and c had not beaten); the second is at a new
    # membership, whose windows start afresh; three more fill every member's 3 windows, and confirm
    # takes one more.
    for _ in range(6):
        replies = [beat(state, "a", 0.1, 0.5), beat(state, "b", 0.1, 0.5), beat(state, "c", 0.45, 0.5)]
    assert [r.get("park", "") for r in replies][:2] == ["", ""] and "leave" not in replies[2]
    assert replies[2]["park"].startswith("autoscale: 2 nodes train"), "c's own window completed the second"
    [parked] = [d for d in state.journal.decisions() if d["action"] == "park"]
    assert parked["details"]["node_id"] == "c" and parked["details"]["cause"] == "autoscale"
    scale = state.status()["autoscale"]
    assert (scale["mode"], scale["current"], scale["best"], scale["keep"]) == ("on", 3, 2, ["a", "b"])
    registry = CollectorRegistry()
    registry.register(JournalCollector(state))
    text = generate_latest(registry).decode()
    assert "stalwart_autoscale_recommended_nodes 2.0" in text and "stalwart_autoscale_current_nodes 3.0" in text
    # c waits as a parked spare (member False). Judged by its last window, it stays parked ...
    for _ in range(3):
        beat(state, "a", 0.1, 0.2), beat(state, "b", 0.1, 0.2)
        assert state.heartbeat({"node_id": "c", "progress": {"member": False}})["park"]
    assert state.status()["autoscale"]["best"] == 2 and state.status()["spares"] == ["c"]
    # ... until the two left are slow enough that three, c included, would train faster: it rejoins
    # (judged by the fastest of their last 3 windows: slow from the third slow one; confirm takes one more).
    for _ in range(3):
        beat(state, "a", 0.5, 0.6), beat(state, "b", 0.5, 0.6)
    assert state.heartbeat({"node_id": "c", "progress": {"member": False}})["park"], "not yet confirmed"
    for _ in range(1):
        beat(state, "a", 0.5, 0.6), beat(state, "b", 0.5, 0.6)
    assert "park" not in state.heartbeat({"node_id": "c", "progress": {"member": False}})
    [unparked] = [d for d in state.journal.decisions() if d["action"] == "unpark"]
    assert unparked["details"]["node_id"] == "c" and unparked["details"]["best"] == 3


def test_a_burst_of_slow_windows_is_noise_not_a_reason_to_park():
    """A node counts as the fastest of its latest windows: two windows in a row slowed by a neighbour's
    burst (two cores shared by three nodes in CI) park no node; a node that stays slow is parked."""
    policy = AutoscalePolicy(mode="on", restart_cost_s=1.0, horizon_s=600.0, cooldown_s=0.0, confirm=2)
    scaler, members = Autoscaler(policy), ["a", "b", "c"]
    even = {"a": 0.8, "b": 0.8, "c": 0.6}

    def window(t: int, compute: dict[str, float], live: list[str] = members, spares: list[str] = ()):
        windows(scaler, compute, 1.3 if len(live) < 3 else 1.0, float(t))
        rec = scaler.recommend(live, 2, 3, spares=list(spares), now=float(t))
        return rec, scaler.action(rec, live, now=float(t))

    bursts = [{}, {}, {"b": 1.6}, {"b": 1.6}, {}, {}, {"b": 1.6}, {"b": 1.6}, {}]
    assert [window(t, {**even, **b})[1] for t, b in enumerate(bursts)] == [None] * 9, "bursts are noise"
    acted = {t: window(t, {**even, "b": 1.6})[1] for t in range(9, 13)}
    assert acted[9] is acted[10] is acted[11] is None and acted[12][:2] == ("park", "b"), (
        "slow in all of its last 3 windows (from window 11), confirmed twice: parked"
    )
    # after a regroup the members' older windows (another share of the batch) no longer count, nor does
    # the first window after it (it may have been measured before): then one window is a whole history
    # only with smooth=1
    assert scaler.recommend(["a", "c"], 2, 3, now=12.0) is None, "no new window since the last recommendation"
    windows(scaler, {"a": 0.5, "c": 0.5}, 0.6, 13.0)
    assert scaler.recommend(["a", "c"], 2, 3, spares=["b"], now=13.0) is None, "a window of the old membership?"
    windows(scaler, {"a": 1.2, "c": 0.9}, 1.3, 14.0)
    rec = scaler.recommend(["a", "c"], 2, 3, spares=["b"], now=14.0)
    assert rec.step_s[2] == pytest.approx(1.3) and rec.comm_s == pytest.approx(0.1), "a's 0.8 and 0.5 are forgotten"
    # a stalled node's windows from before its stall do not count either (stale_s, 30 s)
    windows(scaler, {"a": 1.0, "c": 0.9}, 1.1, 100.0)
    assert scaler.recommend(["a", "c"], 2, 3, now=100.0).comm_s == pytest.approx(0.1), "1.2 s was stale"
    with pytest.raises(ValueError, match="smooth ≥ 1"):
        AutoscalePolicy(smooth=0)


def test_after_a_regroup_two_slow_windows_are_still_noise():
    """A membership change starts every member's windows afresh: acting waits until each member has
    ``smooth`` windows again, so the first, noisiest windows after a regroup park nothing."""
    policy = AutoscalePolicy(mode="on", restart_cost_s=1.0, horizon_s=600.0, cooldown_s=0.0, confirm=2)
    scaler, three, four = Autoscaler(policy), ["a", "b", "c"], ["a", "b", "c", "d"]
    steady = {"a": 0.8, "b": 0.8, "c": 0.8}
    acted = []
    for t in range(3):
        windows(scaler, steady, 1.0, float(t))
        acted.append(scaler.action(scaler.recommend(three, 2, 4, now=float(t)), three, now=float(t)))
    for t in range(3, 6):
        windows(scaler, {**steady, "d": 0.8}, 1.0, float(t))
        rec = scaler.recommend(four, 2, 4, now=float(t))
        acted.append(rec and scaler.action(rec, four, now=float(t)))
    for t, b in ((6, 1.6), (7, 1.6), (8, 0.8), (9, 0.8), (10, 0.8)):  # back at three, b slowed twice at once
        windows(scaler, {**steady, "b": b}, 1.0, float(t))
        rec = scaler.recommend(three, 2, 4, now=float(t))
        acted.append(rec and scaler.action(rec, three, now=float(t)))
    assert not any(acted), acted
