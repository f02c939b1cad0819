"""The data plane of a plan when the keepers act on the decider (checkpoint/plan_write.py): two nodes'
real snapshots, a real decider, real storage; each node plans the layout itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stalwart.checkpoint import Storage, plan_write
from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider import Decider
from stalwart.checkpoint.persist import write_checkpoint
from stalwart.checkpoint.shm import JobPaths, complete_slots
from stalwart.checkpoint.snapshot import SnapshotView
from tests.unit.two_nodes import WORLD, snapshot, two_node_dirs

NODES = {"A": [0], "B": [1]}


@pytest.fixture
def nodes():
    yield from two_node_dirs()


def view(paths: JobPaths, rank: int, step: int) -> SnapshotView:
    return SnapshotView(paths, next(i for i in complete_slots(paths, rank) if i.step == step))


def persist_through_the_decider(nodes: list[JobPaths], storage: Storage, step: int, fail_first: bool = False):
    """Node A holds rank 0, node B rank 1: Persist → tables, Pinned → Write → shares, Wrote → Commit."""
    d = Decider(NODES)
    held = ((step, 0, (0,), False),)
    d.handle(ev.Holding("A", 0, 1, held))
    d.handle(ev.Holding("B", 0, 1, ((step, 0, (1,), False),)))
    (plan,) = [x for x in d.handle(ev.PersistDue(step, 0)) if isinstance(x, ev.Persist)]
    views = {name: {r: view(nodes[r], r, step) for r in dict(plan.writers)[name]} for name in NODES}
    try:
        writes = []
        for name in NODES:
            plan_write.put_tables(storage, step, plan.plan, views[name])
            writes += [x for x in d.handle(ev.Pinned(name, plan.plan, True)) if isinstance(x, ev.Write)]
        (write,) = writes
        if fail_first:  # attempt 1 is written, then node B reports a failure: every node writes attempt 2
            for name in NODES:
                plan_write.write_share(storage, step, plan.plan, 1, WORLD, views[name])
            (write,) = retry(d, plan)
        commits = []
        for name in NODES:
            plan_write.write_share(storage, step, write.plan, write.attempt, WORLD, views[name])
            commits += [x for x in d.handle(ev.Wrote(name, plan.plan, write.attempt, True)) if isinstance(x, ev.Commit)]
        (order,) = commits
        manifest = plan_write.commit_plan(storage, order.step, order.plan, write.attempt, WORLD, "test")
        d.handle(ev.Committed(order.plan, True))
        return d, manifest, [views[n][r] for n in NODES for r in views[n]]
    finally:
        for by_rank in views.values():
            for v in by_rank.values():
                v.close()


def retry(d: Decider, plan: ev.Persist) -> list[ev.Write]:
    (again,) = [x for x in d.handle(ev.Wrote("B", plan.plan, 1, False, "disk full")) if isinstance(x, ev.Persist)]
    assert again.attempt == 2
    out = [x for name in NODES for x in d.handle(ev.Pinned(name, plan.plan, True, attempt=2))]
    return [x for x in out if isinstance(x, ev.Write)]


def test_each_node_plans_the_same_layout_and_the_committed_step_is_dcps_own(nodes, tmp_path):
    model = snapshot(nodes[0], 0, [3])
    snapshot(nodes[1], 1, [3])
    storage = Storage(str(tmp_path / "ckpt"))
    d, manifest, _ = persist_through_the_decider(nodes, storage, 3)
    assert d.latest == 3 and storage.latest() == 3 and storage.verify(3) == []
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert shards and all(name.startswith("__p1a1_") for name in shards), shards
    assert not (tmp_path / "ckpt" / "step-00000003" / "p1").exists(), "tables and results go after the commit"
    target = {f"model.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=storage.checkpoint_id(3), no_dist=True)  # plain DCP reads it
    assert all(torch.equal(target[f"model.{k}"], v) for k, v in model.state_dict().items())
    # The layout is the one a single writer of both ranks makes (DCP's de-duplication of replicated items).
    alone = Storage(str(tmp_path / "alone"))
    views = [view(nodes[r], r, 3) for r in range(WORLD)]
    try:
        write_checkpoint(alone, 3, views, "test")
    finally:
        for v in views:
            v.close()
    ours, theirs = storage.read_metadata(3), alone.read_metadata(3)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert {i.fqn for i in ours.storage_data} == {i.fqn for i in theirs.storage_data}


def test_a_retry_writes_under_its_own_name_so_a_late_write_of_the_first_attempt_never_lands(nodes, tmp_path):
    model = snapshot(nodes[0], 0, [2])
    snapshot(nodes[1], 1, [2])
    storage = Storage(str(tmp_path / "ckpt"))
    _, manifest, _ = persist_through_the_decider(nodes, storage, 2, fail_first=True)
    named = {name for name in manifest["files"] if name.endswith(".distcp")}
    assert named and all(name.startswith("__p1a2_") for name in named), named
    step_dir = tmp_path / "ckpt" / "step-00000002"
    for stale in step_dir.glob("__p1a1_*.distcp"):  # attempt 1's writer, late: its bytes torn
        stale.write_bytes(b"torn")
    assert storage.verify(2) == []
    target = {f"model.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=storage.checkpoint_id(2), no_dist=True)
    assert all(torch.equal(target[f"model.{k}"], v) for k, v in model.state_dict().items())


def test_a_table_missing_from_storage_fails_the_write_with_its_name(nodes, tmp_path):
    snapshot(nodes[0], 0, [1])
    storage = Storage(str(tmp_path / "ckpt"))
    v = view(nodes[0], 0, 1)
    try:
        plan_write.put_tables(storage, 1, 5, {0: v})
        with pytest.raises(RuntimeError, match=r"rank 1's table is not in storage \(table.rank1.json\)"):
            plan_write.write_share(storage, 1, 5, 1, WORLD, {0: v})
    finally:
        v.close()


def test_a_given_up_plan_leaves_nothing_and_takes_nothing_of_another_plan_of_the_step(nodes, tmp_path):
    snapshot(nodes[0], 0, [4])
    snapshot(nodes[1], 1, [4])
    storage = Storage(str(tmp_path / "ckpt"))
    views = {r: view(nodes[r], r, 4) for r in range(WORLD)}
    try:
        plan_write.put_tables(storage, 4, 1, views)
        plan_write.write_share(storage, 4, 1, 1, WORLD, {0: views[0]})  # rank 1's node was lost meanwhile
        plan_write.put_tables(storage, 4, 2, views)  # the save-on-failure's plan of the same step
    finally:
        for v in views.values():
            v.close()
    step_dir = tmp_path / "ckpt" / "step-00000004"
    assert list(step_dir.glob("__p1a1_0_*.distcp")) and (step_dir / "p1").is_dir()
    plan_write.remove_plan(storage, 4, 1)
    assert sorted(p.name for p in step_dir.iterdir()) == ["p2"], "plan 1's shards and tables went, plan 2's stay"
    assert sorted(p.name for p in (step_dir / "p2").iterdir()) == ["table.rank0.json", "table.rank1.json"]
