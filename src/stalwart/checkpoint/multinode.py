"""Persist one step of a job that spans nodes: each node's keeper writes its own ranks' shards and
the keeper on rank 0's node (the *coordinator*) plans and commits.

The keepers meet through small JSON files in the checkpoint storage itself (``DIR/.stage/step-N/``),
which every node must reach anyway: no extra service, port or pickle, and a dead participant costs
a timeout, never a bad checkpoint — ``latest`` moves only after every rank's shards are durable.

    every node                                 coordinator
    plans/rank{r}.json  (entry tables)    →    waits for all ranks' tables (a "missing" one aborts)
                                               DCP global plan + metadata → go.json {attempt, items}
    writes its shards (fsync)             ←
    results/rank{r}.{attempt}.json        →    waits for all; .metadata → manifest → latest
    waits for the manifest and latest

Which step: steps flagged for persistence in every rank's snapshot header (``persist_every_steps``,
or an explicit ``save(..., persist=True)``) — the same on all nodes without talking. The coordinator
can also ask for a step (save-on-failure) in ``DIR/.stage/request.json``; a node that no longer
holds it answers "missing" and the coordinator tries an older one.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from stalwart.checkpoint import stage
from stalwart.checkpoint.membership import LostNodes
from stalwart.checkpoint.multinode_wire import plan_from_json, plan_json, results_from_json, results_json
from stalwart.checkpoint.persist import (
    PlanOnlyView,
    _SnapshotPlanner,
    chaos_hook,
    commit,
    global_plan,
    plan_table,
    torch_save_without_crc,
    write_rank,
)
from stalwart.checkpoint.snapshot import SnapshotView, epoch_of
from stalwart.checkpoint.storage import Storage


def _wait(storage: Storage, step: int, deadline: float, poll_s: float, what: str, probe: Any) -> Any:
    while True:
        value = probe()
        if value is not None:
            return value
        if (stop := stage.get(storage, *stage.stage_of(step, "abort.json"))) is not None:
            raise RuntimeError(f"persist of step {step} aborted by the coordinator: {stop['reason']}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"persist of step {step}: timed out waiting for {what}")
        time.sleep(poll_s)
        storage.refresh()


def _put_table(storage: Storage, step: int, rank: int, views: dict[int, SnapshotView], node: str | None) -> None:
    stage.put(
        storage,
        {
            **plan_table(views[rank]),
            "first": min(views),
            "epoch": epoch_of(views[min(views)].info.header),
            "node": node,  # the job master's node id: the coordinator asks whether it is lost
        },
        *stage.stage_of(step, "plans", f"rank{rank}.json"),
    )


# -- the protocol ---------------------------------------------------------------------------------
def persist(
    storage: Storage,
    step: int,
    views: dict[int, SnapshotView],
    world: int,
    source: str,
    coordinator: bool,
    timeout_s: float = 120.0,
    poll_s: float = 0.05,
    answer_s: float = 10.0,
    ask_others: bool = False,
    on_planned: Callable[[int], None] | None = None,
    members: LostNodes | None = None,
) -> dict[str, Any]:
    """Take part in persisting ``step`` with this node's ranks (``views``: rank → pinned snapshot).
    Every node must answer (its entry tables) within ``answer_s`` — a lost node must not hold up a
    save-on-failure for long — and the whole persist finish within ``timeout_s``. The coordinator asks
    the others for the step (``ask_others``) once the stage is clean. Returns the committed manifest;
    raises MissingSnapshot (``Abandoned``: a dead end), RuntimeError (aborted) or TimeoutError.
    ``on_planned(step)``: the coordinator's word that every node holds the step pinned (its table is in),
    so the rest of the persist can no longer lose it to a restarted worker's snapshot. ``members``: the
    job master's lost nodes; a node the persist waits on that is lost gives it up at once (NodeLost)."""
    t0, deadline = time.perf_counter(), time.monotonic() + timeout_s
    epoch = epoch_of(views[min(views)].info.header)  # this node's snapshot of the step: what a dead end names
    if not coordinator:
        stage.raise_if_dead_end(storage, step, epoch)
    for r in views:  # nodes skip steps (a keeper that started late): whoever waits for us sees we moved on
        stage.put(storage, {"step": step, "epoch": epoch}, stage.STAGE, "cursor", f"rank{r}.json")
    if coordinator:
        # A failed earlier attempt at this step (a table left by an execution that failed is a dead end).
        for name in ("go.json", "abort.json", "results"):
            stage.remove(storage, *stage.stage_of(step, name))
        storage.remove(step)
        if ask_others:
            stage.request(storage, step)
    node = members.me if members is not None else None
    for r in views:
        _put_table(storage, step, r, views, node)
    if coordinator:
        return _coordinate(storage, step, views, world, source, t0, deadline, poll_s, answer_s, on_planned, members)
    return _participate(storage, step, views, t0, deadline, poll_s, members)


def _table_unless_lost(storage: Storage, rank: int, step: int, members: LostNodes | None) -> Any:
    """Rank ``rank``'s table, None while it is not in; NodeLost once the master holds its node lost (its
    keeper reported the node's ranks), instead of waiting out ``answer_s``."""
    found = stage.table(storage, rank, step)
    if found is None and members is not None:
        members.raise_if_rank_lost(rank, step)
    return found


def abort(storage: Storage, step: int, reason: str) -> None:
    stage.put(storage, {"reason": reason, "time": time.time()}, *stage.stage_of(step, "abort.json"))


def _coordinate(
    storage: Storage,
    step: int,
    views: dict[int, SnapshotView],
    world: int,
    source: str,
    t0: float,
    deadline: float,
    poll_s: float,
    answer_s: float,
    on_planned: Callable[[int], None] | None = None,
    members: LostNodes | None = None,
) -> dict[str, Any]:
    try:
        tables: dict[int, dict[str, Any]] = {}
        answer_by = min(deadline, time.monotonic() + answer_s)
        for r in range(world):
            if r not in views:
                tables[r] = _wait(
                    storage,
                    step,
                    answer_by,
                    poll_s,
                    f"rank {r}'s snapshot table (its node's keeper)",
                    lambda r=r: _table_unless_lost(storage, r, step, members),
                )
                if "missing" in tables[r]:
                    raise stage.MissingSnapshot(f"rank {r} does not hold step {step}: {tables[r]['missing']}")
        if on_planned is not None:
            on_planned(step)
        every = [views[r] if r in views else PlanOnlyView(tables[r]) for r in range(world)]
        planners, plans, metadata = global_plan(storage, step, every)
        attempt = uuid.uuid4().hex[:12]
        stage.put(
            storage,
            {"attempt": attempt, "plans": {str(r): plan_json(plans[r]) for r in range(world)}},
            *stage.stage_of(step, "go.json"),
        )
        sums: dict[str, dict[str, int]] = {}
        results: dict[int, list[WriteResult]] = {}
        hook = chaos_hook(step)
        with torch_save_without_crc():
            for r in views:
                results[r] = write_rank(storage, step, r, planners[r], plans[r], sums, hook)
        alive = _Liveness(storage, step, answer_s)
        node_of = {r: int(tables[r].get("first", r)) for r in tables}  # heartbeats are per node

        def result_of(r: int) -> Any:
            found = stage.get(storage, *stage.stage_of(step, "results", f"rank{r}.{attempt}.json"))
            if found is None:
                if members is not None:
                    members.raise_if_lost(tables[r].get("node"), step, f"rank {r}'s")
                alive.check(node_of[r])
            return found

        for r in range(world):
            if r not in views:
                done = _wait(storage, step, deadline, poll_s, f"rank {r}'s shards", lambda r=r: result_of(r))
                if "error" in done:
                    raise RuntimeError(f"rank {r}'s node could not write its shards: {done['error']}")
                results[r] = results_from_json(done["results"])
                sums.update(done["sums"])
        snapshot_time = max(v.info.header["time"] for v in views.values())
        manifest = commit(
            storage, step, metadata, [results[r] for r in range(world)], sums, world, source, snapshot_time, t0
        )
    except BaseException as err:
        abort(storage, step, repr(err))
        raise
    # Earlier steps are finished too: aborted or skipped ones left their stage (a participant still
    # waiting there sees our cursor moved on). Only a keeper's start tidied them before.
    stage.clear_stage(storage, below=step + 1)
    return manifest


def _participate(
    storage: Storage,
    step: int,
    views: dict[int, SnapshotView],
    t0: float,
    deadline: float,
    poll_s: float,
    members: LostNodes | None = None,
) -> dict[str, Any]:
    epoch = epoch_of(views[min(views)].info.header)
    coordinator_node: list[str | None] = []  # from rank 0's table, once it is in

    def raise_if_coordinator_lost() -> None:
        if members is None:
            return
        if (
            not coordinator_node
            and (table := stage.get(storage, *stage.stage_of(step, "plans", "rank0.json"))) is not None
        ):
            coordinator_node.append(table.get("node"))
        if coordinator_node:
            members.raise_if_lost(coordinator_node[0], step, "the coordinator's")

    def go_or_replan() -> Any:
        if (stop := stage.get(storage, *stage.stage_of(step, "abort.json"))) is not None:  # before a re-put below
            raise RuntimeError(f"persist of step {step} aborted by the coordinator: {stop['reason']}")
        stage.raise_if_dead_end(storage, step, epoch)
        go = stage.get(storage, *stage.stage_of(step, "go.json"))
        if go is None and stage.moved_on(storage, 0, step):
            raise stage.MissingSnapshot(f"the coordinator moved on past step {step}")
        for r in views:  # a coordinator that started later may have tidied the stage
            if go is None and not storage.fs.exists(storage.path(*stage.stage_of(step, "plans", f"rank{r}.json"))):
                _put_table(storage, step, r, views, members.me if members is not None else None)
        if go is None:
            raise_if_coordinator_lost()
        return go

    go = _wait(storage, step, deadline, poll_s, "the coordinator's plan", go_or_replan)
    attempt = go["attempt"]
    hook = chaos_hook(step)
    with _Heartbeat(storage, step, min(views)):
        reports = _write_shares(storage, step, views, go, attempt, hook)
    # Only after the last beat: once every result is in, the coordinator commits and removes the stage,
    # and a beat still on its way would write it back (a stage directory left behind, seen under load).
    for r, report in reports.items():
        stage.put(storage, report, *stage.stage_of(step, "results", f"rank{r}.{attempt}.json"))

    def committed() -> dict[str, Any] | None:
        latest = storage.latest()
        if latest is not None and latest >= step:
            return storage.manifest(step)
        raise_if_coordinator_lost()
        return None

    manifest = _wait(storage, step, deadline, poll_s, "the commit", committed)
    return {**manifest, "commit_s": time.perf_counter() - t0}


def _write_shares(
    storage: Storage, step: int, views: dict[int, SnapshotView], go: dict[str, Any], attempt: str, hook: Any
) -> dict[int, dict[str, Any]]:
    """Write each rank's shards; rank → its results for the coordinator (a failure is reported at once)."""
    reports = {}
    for r, view in views.items():
        sums: dict[str, dict[str, int]] = {}
        try:
            planner = _SnapshotPlanner(view)
            planner.set_up_planner(is_coordinator=False)
            with torch_save_without_crc():
                results = write_rank(
                    storage, step, r, planner, plan_from_json(planner, go["plans"][str(r)]), sums, hook
                )
        except Exception as err:
            stage.put(storage, {"error": repr(err)}, *stage.stage_of(step, "results", f"rank{r}.{attempt}.json"))
            raise
        reports[r] = {"results": results_json(results), "sums": sums}
    return reports


class _Heartbeat:
    """While a participant writes its shards, a counter in storage ticks every second, so the
    coordinator can tell a slow node (keep waiting) from a lost one (give up after ``answer_s``)."""

    def __init__(self, storage: Storage, step: int, first_rank: int) -> None:
        self.storage, self.parts = storage, stage.stage_of(step, "alive", f"rank{first_rank}.json")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="stalwart-persist-heartbeat", daemon=True)

    def _beat(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                stage.put(self.storage, {"beat": n}, *self.parts)
            except OSError:
                pass  # storage trouble shows up in the shard writes themselves
            self.stop.wait(1.0)

    def __enter__(self) -> _Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        self.thread.join(5)


class _Liveness:
    """The coordinator's view of participants' heartbeats: dead when a beat has not changed for
    ``answer_s`` seconds of the coordinator's own clock (no clock comparison across nodes)."""

    def __init__(self, storage: Storage, step: int, answer_s: float) -> None:
        self.storage, self.step, self.answer_s = storage, step, answer_s
        self.seen: dict[int, tuple[Any, float]] = {}

    def check(self, rank: int) -> None:
        beat = stage.get(self.storage, *stage.stage_of(self.step, "alive", f"rank{rank}.json"))
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or beat != last[0]:
            self.seen[rank] = (beat, now)
        elif now - last[1] > self.answer_s:
            raise TimeoutError(
                f"persist of step {self.step}: rank {rank}'s node stopped writing "
                f"(no heartbeat for {self.answer_s:.0f} s); its node is probably lost"
            )
