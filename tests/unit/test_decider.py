"""The checkpoint decider's key transitions, one event at a time (docs/protocol.md)."""

from __future__ import annotations

import json

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider import Decider
from stalwart.checkpoint.decider_wire import from_state, to_state

NODES = {"A": [0, 1], "B": [2, 3]}


def held(*keys: tuple[int, int], ranks: tuple[int, ...], pinned: bool = False) -> ev.Held:
    return tuple((s, e, ranks, pinned) for s, e in keys)


def holding(d: Decider, node: str, *keys: tuple[int, int], seq: int, inc: int = 0) -> list:
    return d.handle(ev.Holding(node, inc, seq, held(*keys, ranks=tuple(NODES[node]))))


def of(kind: type, decisions: list) -> list:
    return [x for x in decisions if isinstance(x, kind)]


def persist_started(d: Decider, step: int = 2) -> ev.Persist:
    holding(d, "A", (step, 0), seq=1)
    out = d.handle(ev.PersistDue(step, 0)) + holding(d, "B", (step, 0), seq=1)
    (plan,) = of(ev.Persist, out)
    return plan


def test_a_due_step_is_persisted_once_every_rank_holds_it_then_committed() -> None:
    d = Decider(NODES)
    holding(d, "A", (2, 0), seq=1)
    assert d.handle(ev.PersistDue(2, 0)) == []  # B's ranks do not hold it yet: wait for its report
    (plan,) = of(ev.Persist, holding(d, "B", (2, 0), seq=1))
    assert plan.key == (2, 0) and plan.nodes == ("A", "B") and not plan.failure
    assert d.handle(ev.Wrote("A", plan.plan, 1, True)) == []
    (commit,) = d.handle(ev.Wrote("B", plan.plan, 1, True))
    assert commit == ev.Commit(plan.plan, 2, 0)
    out = d.handle(ev.Committed(plan.plan, True))
    assert of(ev.Release, out) == [ev.Release(None, (2, 0), plan.plan, 0)] and d.latest == 2 and d.idle()


def test_duplicates_and_old_plans_are_ignored_and_logged() -> None:
    d = Decider(NODES)
    plan = persist_started(d)
    assert d.handle(ev.PersistDue(2, 0)) == []  # the same step again (another node's flag)
    assert d.handle(ev.Wrote("A", plan.plan + 7, 1, True)) == []
    assert holding(d, "B", (2, 0), seq=1) == []  # an old report
    assert any("late message about plan" in line for line in d.log)
    assert any("ignored a stale, unknown or lost node's report" in line for line in d.log)


def test_a_node_lost_mid_persist_gives_it_up_at_once() -> None:
    d = Decider(NODES)
    plan = persist_started(d)
    out = d.handle(ev.NodeLost("B", 0))
    (give_up,) = of(ev.GiveUp, out)
    assert give_up.plan == plan.plan and "lost" in give_up.why
    assert {type(x) for x in out} == {ev.GiveUp, ev.Release}  # nothing waits for the lost node
    # its memory went with it: the failure's save has nothing every rank holds
    (go,) = of(ev.RestartMayProceed, d.handle(ev.WorkersGone("A", 0, held((2, 0), ranks=(0, 1)))))
    assert go.key is None and "no step" in go.why


def test_save_on_failure_pins_the_newest_step_every_rank_holds_then_commits_in_the_background() -> None:
    d = Decider(NODES)
    # the mirror case: B's rank 3 died copying step 4, so only step 3 is held by every rank
    assert d.handle(ev.WorkersGone("B", 0, held((3, 0), ranks=(2, 3)) + held((4, 0), ranks=(2,)))) == []
    out = d.handle(ev.WorkersGone("A", 0, held((3, 0), (4, 0), ranks=(0, 1))))
    (plan,) = of(ev.Persist, out)
    assert plan.key == (3, 0) and plan.failure
    assert d.handle(ev.Pinned("A", plan.plan, True)) == []
    write, go = d.handle(ev.Pinned("B", plan.plan, True))
    assert write == ev.Write(plan.plan, (3, 0), 1, 0), "every node pinned: each writes its share"
    assert go == ev.RestartMayProceed(0, (3, 0), "every node holds it pinned")
    d.handle(ev.EpochBegan(1, (("A", (0, 1)), ("B", (2, 3)))))
    d.handle(ev.Wrote("A", plan.plan, 1, True))
    assert of(ev.Commit, d.handle(ev.Wrote("B", plan.plan, 1, True))) == [ev.Commit(plan.plan, 3, 1)]
    d.handle(ev.Committed(plan.plan, True))
    assert d.latest == 3 and d.idle()


def test_a_node_missing_the_step_makes_the_save_try_an_older_one_before_the_restart() -> None:
    d = Decider(NODES)
    d.handle(ev.WorkersGone("A", 0, held((3, 0), (4, 0), ranks=(0, 1))))
    (plan,) = of(ev.Persist, d.handle(ev.WorkersGone("B", 0, held((3, 0), (4, 0), ranks=(2, 3)))))
    out = d.handle(ev.Pinned("B", plan.plan, False, "overwritten"))
    assert not of(ev.RestartMayProceed, out)
    (older,) = of(ev.Persist, out)
    assert older.key == (3, 0) and older.failure


def test_late_word_of_an_earlier_epoch_is_ignored() -> None:
    d = Decider(NODES)
    d.handle(ev.WorkersGone("A", 0, ()))
    d.handle(ev.WorkersGone("B", 0, ()))
    d.handle(ev.EpochBegan(1, (("A", (0, 1)), ("B", (2, 3)))))
    assert d.handle(ev.WorkersGone("A", 0, ())) == [] and d.failure is None
    assert d.handle(ev.PersistDue(6, 0)) == [] and d.due is None
    assert d.handle(ev.EpochBegan(1, (("A", (0, 1)),))) == [] and set(d.nodes) == {"A", "B"}
    assert sum("ignored late" in line for line in d.log) == 3


def test_a_lost_nodes_ranks_are_saved_from_the_copies_a_survivor_holds() -> None:
    """Peer copies count as held: after node B is lost, A holds B's ranks' step 5 as copies and its own
    step 5 and 6; the save-on-failure persists step 5, every rank written by A, and the restart may
    proceed from memory once A pinned it."""
    d = Decider(NODES)
    d.handle(ev.NodeLost("B", 0))
    final = ((5, 0, (0, 1, 2, 3), False), (6, 0, (0, 1), False))
    (persist,) = of(ev.Persist, d.handle(ev.WorkersGone("A", 0, final)))
    assert persist.key == (5, 0) and persist.failure
    assert persist.nodes == ("A",) and persist.writers == (("A", (0, 1, 2, 3)),)
    (go,) = of(ev.RestartMayProceed, d.handle(ev.Pinned("A", persist.plan, True)))
    assert go.key == (5, 0)


def test_a_peers_newer_copy_does_not_make_a_rank_look_moved_past() -> None:
    """B's copy of rank 0 at step 3 reaches the decider before A's own report of step 2 (with its pin):
    step 2 waits for A's word instead of being given up."""
    d = Decider(NODES)
    d.handle(ev.Holding("B", 0, 1, ((2, 0, (2, 3), True), (3, 0, (0, 1), False))))
    assert not of(ev.GiveUp, d.handle(ev.PersistDue(2, 0))) and d.due == 2
    (plan,) = of(ev.Persist, pinned_holding(d, "A", [(2, 0)], [(3, 0)], seq=1))
    assert plan.key == (2, 0) and plan.writers == (("A", (0, 1)), ("B", (2, 3)))


def test_a_grown_or_shrunk_job_is_planned_over_its_new_ranks() -> None:
    d = Decider(NODES)
    d.handle(ev.EpochBegan(1, (("A", (0, 1)), ("B", (2, 3)), ("C", (4, 5)))))  # grown
    holding(d, "A", (4, 1), seq=1), holding(d, "B", (4, 1), seq=1)
    assert d.handle(ev.PersistDue(4, 1)) == [], "C's ranks are part of the world now"
    (plan,) = of(ev.Persist, d.handle(ev.Holding("C", 0, 1, held((4, 1), ranks=(4, 5)))))
    assert plan.nodes == ("A", "B", "C") and plan.writers[-1] == ("C", (4, 5))
    d.handle(ev.EpochBegan(2, (("A", (0, 1)),)))  # shrunk to one node (the plan went with B and C)
    (plan,) = of(ev.Persist, holding(d, "A", (6, 2), seq=2) + d.handle(ev.PersistDue(6, 2)))
    assert plan.key == (6, 2) and plan.writers == (("A", (0, 1)),)


def test_a_lost_nodes_late_word_is_ignored() -> None:
    """B's final holdings were on their way when B was lost: its memory went with it, they count for
    nothing (counted, the save would pick a step only B held and find no node to write it)."""
    d = Decider(NODES)
    d.handle(ev.NodeLost("B", 0))
    assert d.handle(ev.WorkersGone("B", 0, held((7, 0), ranks=(0, 1, 2, 3)))) == []
    assert holding(d, "B", (7, 0), seq=1) == [] and d.held["B"] == {}
    (go,) = of(ev.RestartMayProceed, d.handle(ev.WorkersGone("A", 0, held((7, 0), ranks=(0, 1)))))
    assert go.key is None


def test_a_due_step_given_up_unplanned_releases_its_pins() -> None:
    d = Decider(NODES)
    pinned_holding(d, "A", [(2, 0)], [], seq=1)
    d.handle(ev.PersistDue(2, 0))
    out = d.handle(ev.Holding("B", 0, 1, held((3, 0), (4, 0), ranks=(2, 3))))  # B's keeper never saw 2
    assert of(ev.GiveUp, out) and ev.Release("A", (2, 0), 0, 0) in out and d.pins["A"] == []


def test_a_rank_that_moved_past_a_due_step_gives_it_up() -> None:
    d = Decider(NODES)
    holding(d, "A", (2, 0), seq=1)
    d.handle(ev.PersistDue(2, 0))
    (give_up,) = of(ev.GiveUp, holding(d, "B", (3, 0), (4, 0), seq=1))
    assert give_up.step == 2 and "moved past" in give_up.why and d.idle()


def pinned_holding(d: Decider, node: str, pins: list[tuple[int, int]], others: list[tuple[int, int]], seq: int) -> list:
    report = held(*pins, ranks=tuple(NODES[node]), pinned=True) + held(*others, ranks=tuple(NODES[node]))
    return d.handle(ev.Holding(node, 0, seq, report))


def test_a_due_step_pinned_on_sight_is_planned_although_the_ranks_moved_on() -> None:
    """Keepers pin a flagged step when they see it: the workers' newer snapshots, reported before the
    PersistDue arrives, no longer make the step look moved past — and the pin is not released."""
    d = Decider(NODES)
    assert pinned_holding(d, "A", [(2, 0)], [(4, 0)], seq=1) == []
    assert pinned_holding(d, "B", [(2, 0)], [(3, 0), (4, 0)], seq=1) == []  # kept: it may yet be planned
    (plan,) = d.handle(ev.PersistDue(2, 0))
    assert plan.key == (2, 0) and not of(ev.GiveUp, [plan])


def test_pins_nobody_will_ask_for_are_released_once() -> None:
    d = Decider(NODES)
    pinned_holding(d, "A", [(2, 0)], [], seq=1)
    d.handle(ev.PersistDue(2, 0))  # B has not reported: step 2 waits, A's pin stays
    assert d.due == 2 and d.pins["A"] == [(2, 0)]
    out = pinned_holding(d, "A", [(2, 0), (4, 0)], [], seq=2) + d.handle(ev.PersistDue(4, 0))
    assert of(ev.Release, out) == [ev.Release("A", (2, 0), 0, 0)]  # superseded by step 4: its pin goes
    assert d.handle(ev.PersistDue(4, 0)) == []  # said once, until a report shows it pinned again
    out = d.handle(ev.EpochBegan(1, (("A", (0, 1)), ("B", (2, 3)))))  # (a failure's end, say)
    assert out == [ev.Release("A", (4, 0), 0, 1)] and d.pins["A"] == []  # the earlier epoch's pin
    assert pinned_holding(d, "B", [(4, 0)], [], seq=2) == [ev.Release("B", (4, 0), 0, 1)]


def test_a_restarted_keeper_gets_a_new_attempt_and_its_old_word_counts_for_nothing() -> None:
    d = Decider(NODES)
    plan = persist_started(d)
    (again,) = of(ev.Persist, holding(d, "B", (2, 0), seq=1, inc=1))
    assert again.attempt == 2 and again.plan == plan.plan
    d.handle(ev.Wrote("A", plan.plan, 2, True))
    assert d.handle(ev.Wrote("B", plan.plan, 1, True)) == []  # attempt 1's shards may be torn since
    assert of(ev.Commit, d.handle(ev.Wrote("B", plan.plan, 2, True)))


def test_storage_failing_retries_then_gives_up() -> None:
    d = Decider(NODES, max_attempts=2)
    plan = persist_started(d)
    (again,) = of(ev.Persist, d.handle(ev.Wrote("A", plan.plan, 1, False, "EIO")))
    out = d.handle(ev.Wrote("A", plan.plan, again.attempt, False, "EIO"))
    assert of(ev.GiveUp, out) and d.plan is None and d.latest is None


def test_the_job_end_frees_every_snapshot_even_one_reported_later() -> None:
    d = Decider(NODES)
    persist_started(d)
    out = d.handle(ev.JobEnded())
    assert of(ev.GiveUp, out) and ev.Release(None, None, d.next_plan, 0, free=True) in out
    (free,) = holding(d, "A", (2, 0), seq=5, inc=1)  # a keeper that comes back holding something
    assert free.node == "A" and free.free


def test_the_state_survives_json_and_goes_on_the_same() -> None:
    a = Decider(NODES)
    plan = persist_started(a)
    a.handle(ev.WorkersGone("A", 0, held((2, 0), ranks=(0, 1))))
    b = from_state(json.loads(json.dumps(to_state(a))))
    assert to_state(b) == to_state(a)
    for e in (ev.WorkersGone("B", 0, held((2, 0), ranks=(2, 3))), ev.Pinned("A", plan.plan, True)):
        assert a.handle(e) == b.handle(e)
    assert to_state(a) == to_state(b)


def test_the_write_comes_once_every_node_pinned_the_attempt_and_a_pin_of_an_earlier_one_does_not_count() -> None:
    d = Decider(NODES)
    plan = persist_started(d)
    assert d.handle(ev.Pinned("A", plan.plan, True)) == [], "B has not pinned: no write yet"
    holding(d, "A", (2, 0), seq=1, inc=2)  # A's keeper restarted: its pins died with it
    late = d.handle(ev.Pinned("B", plan.plan, True, attempt=1))  # B's pin of attempt 1, on its way meanwhile
    assert not of(ev.Write, late), "a pin of the earlier attempt does not make the retry's write"
    assert not of(ev.Write, d.handle(ev.Pinned("A", plan.plan, True, attempt=2)))
    assert of(ev.Write, d.handle(ev.Pinned("B", plan.plan, True, attempt=2))) == [ev.Write(plan.plan, (2, 0), 2, 0)]
    assert d.handle(ev.Pinned("B", plan.plan, True, attempt=2)) == [], "one write per attempt"


def test_a_rollback_makes_the_redone_steps_persist_again_and_ends_a_plan_of_the_abandoned_future() -> None:
    d = Decider(NODES)
    plan = persist_started(d, step=8)
    for node in NODES:
        d.handle(ev.Pinned(node, plan.plan, True))
        d.handle(ev.Wrote(node, plan.plan, 1, True))
    d.handle(ev.Committed(plan.plan, True))
    holding(d, "A", (10, 0), seq=2)
    (later,) = of(ev.Persist, d.handle(ev.PersistDue(10, 0)) + holding(d, "B", (10, 0), seq=2))
    assert d.latest == 8 and d.plan is not None
    out = d.handle(ev.RolledBack(0, 4))  # a loss spike: back to step 4, steps 8 and 10 abandoned
    assert of(ev.GiveUp, out) == [ev.GiveUp(later.plan, 10, "a rollback abandoned its step", 0)]
    assert d.latest == 4 and d.handle(ev.RolledBack(0, 4)) == [], "every node reports it: once is enough"
    (redone,) = of(
        ev.Persist, d.handle(ev.PersistDue(6, 0)) + holding(d, "A", (6, 0), seq=9) + holding(d, "B", (6, 0), seq=9)
    )
    assert redone.key == (6, 0), "step 6 is below the abandoned step 8 and is persisted again"
