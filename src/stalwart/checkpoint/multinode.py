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

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from stalwart.checkpoint.multinode_wire import plan_from_json, plan_json, results_from_json, results_json
from stalwart.checkpoint.persist import (
    PlanOnlyView,
    _SnapshotPlanner,
    chaos_hook,
    commit,
    global_plan,
    json_bytes,
    plan_table,
    torch_save_without_crc,
    write_rank,
)
from stalwart.checkpoint.snapshot import SnapshotView, epoch_of
from stalwart.checkpoint.storage import Storage, step_name

STAGE = ".stage"
REQUEST = "request.json"
SETTLED = "settled.json"
FAILURE = "failure.json"


class MissingSnapshot(LookupError):
    """A node no longer holds the step asked for (overwritten, or its workers never reached it)."""


class Abandoned(MissingSnapshot):
    """This node's snapshot of the step belongs to an execution that failed before rank 0's node held
    the step: no node can persist it (``declare_failure``)."""


# -- small JSON files in storage ------------------------------------------------------------------
def _put(storage: Storage, obj: Any, *parts: str) -> None:
    if storage.local:
        storage.fs.makedirs(storage.path(*parts[:-1]), exist_ok=True)
    storage.write_atomic(json_bytes(obj), *parts)


def _get(storage: Storage, *parts: str) -> Any:
    text = storage.read_text(*parts)
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:  # an object store never shows half a PUT; a local rename neither
        return None


def _stage(step: int, *parts: str) -> tuple[str, ...]:
    return (STAGE, step_name(step), *parts)


def _remove(storage: Storage, *parts: str) -> None:
    try:
        storage.fs.rm(storage.path(*parts), recursive=True)
    except FileNotFoundError:
        pass


def clear_stage(storage: Storage, below: int) -> None:
    """Remove the stage files of every step below ``below`` (finished: committed or superseded)."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(storage.path(STAGE), detail=False)]
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith("step-") and int(name[5:]) < below:
            _remove(storage, STAGE, name)


def forget_after(storage: Storage, step: int) -> None:
    """A rollback to ``step``: the nodes' cursors, the open request and the stage of every later step
    belong to the abandoned trajectory. Left, a cursor "moved on" past a redone step would make the
    coordinator give that step up, and a stale request would start a persist nobody joins."""
    _remove(storage, STAGE, "cursor")
    _remove(storage, STAGE, REQUEST)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(storage.path(STAGE), detail=False)]
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) > step:
            _remove(storage, STAGE, name)


def request(storage: Storage, step: int) -> None:
    """Ask every node to take part in persisting ``step`` (coordinator only)."""
    _put(storage, {"step": step, "time": time.time()}, STAGE, REQUEST)


def requested_step(storage: Storage) -> int | None:
    req = _get(storage, STAGE, REQUEST)
    return int(req["step"]) if req else None


def settle(storage: Storage, epoch: int, step: int | None, detail: str) -> None:
    """Rank 0's node has finished a save-on-failure for the execution ``epoch``: ``step`` (the newest step
    every rank holds) is durable, or None when no step could be made so (it failed, or no step was
    held by all). The only word a node that waits for that save (a preemption: it must keep its keeper
    up while its shards may be asked for) has that the save is over, when the step it holds itself is
    newer than the one every rank holds."""
    _put(storage, {"step": step, "detail": detail, "epoch": epoch}, STAGE, SETTLED)


def settled(storage: Storage, epoch: int) -> dict[str, Any] | None:
    """The newest save-on-failure's outcome, if it was for the execution ``epoch`` or a later one (a
    save for an earlier execution's fault may finish after a notice and say nothing about it). Epochs,
    not times: the nodes' clocks need not agree."""
    record = _get(storage, STAGE, SETTLED)
    return record if record and int(record.get("epoch", -1)) >= epoch else None


def answer_missing(storage: Storage, step: int, ranks: list[int], why: str) -> None:
    for r in ranks:
        _put(storage, {"missing": why}, *_stage(step, "plans", f"rank{r}.json"))


def _wait(storage: Storage, step: int, deadline: float, poll_s: float, what: str, probe: Any) -> Any:
    while True:
        value = probe()
        if value is not None:
            return value
        if (stop := _get(storage, *_stage(step, "abort.json"))) is not None:
            raise RuntimeError(f"persist of step {step} aborted by the coordinator: {stop['reason']}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"persist of step {step}: timed out waiting for {what}")
        time.sleep(poll_s)
        storage.refresh()


def declare_failure(storage: Storage, epoch: int, newest: int) -> None:
    """Execution ``epoch`` failed, and rank 0's node, its workers gone, will never hold a step of it
    above ``newest``. A later step's snapshot of that execution (or an earlier one) is a dead end: a
    node persisting it waits for a plan that can never come, and its cursor would make every older step
    look missing. The same step redone after the restart belongs to a later execution and is persisted.
    An integer comparison, valid whatever the nodes' clocks say."""
    _put(storage, {"epoch": epoch, "newest": newest}, STAGE, FAILURE)


def forget_records_from(storage: Storage, epoch: int) -> list[str]:
    """Before execution ``epoch`` restores (rank 0): remove the failure and settle records that name it
    or a later one. Within a launch they cannot exist yet (an execution's failure is declared before the
    next one restores); they are an earlier launch's, whose rendezvous rounds started at 0 again, and
    would make this launch's snapshots dead ends and its preemptions settled at once. Returns what went."""
    gone = []
    for name in (FAILURE, SETTLED):
        record = _get(storage, STAGE, name)
        if record is not None and int(record.get("epoch", -1)) >= epoch:
            _remove(storage, STAGE, name)
            gone.append(name)
    return gone


def _dead_end(storage: Storage, step: int, epoch: int | None) -> dict[str, Any] | None:
    """The declared failure that makes this snapshot (``step`` of execution ``epoch``) a dead end, if any."""
    if epoch is None:
        return None
    failure = _get(storage, STAGE, FAILURE)
    if failure and step > int(failure["newest"]) and epoch <= int(failure.get("epoch", -1)):
        return failure
    return None


def _raise_if_dead_end(storage: Storage, step: int, epoch: int | None) -> None:
    if (failure := _dead_end(storage, step, epoch)) is not None:
        raise Abandoned(
            f"step {step} is a dead end: rank 0's node failed holding steps up to {failure['newest']} "
            "and saves one of those"
        )


def _cursor(storage: Storage, rank: int) -> dict[str, Any] | None:
    """The step ``rank``'s node last began to persist, and the execution its snapshot of it belongs to."""
    return _get(storage, STAGE, "cursor", f"rank{rank}.json")


def _moved_on(storage: Storage, rank: int, step: int) -> dict[str, Any] | None:
    """A "missing" answer when ``rank``'s node has started persisting a later step than ``step`` (not a
    dead end: its keeper comes back from one)."""
    cursor = _cursor(storage, rank)
    if cursor and int(cursor["step"]) > step and not _dead_end(storage, int(cursor["step"]), cursor.get("epoch")):
        return {"missing": f"its keeper moved on to step {cursor['step']}"}
    return None


def _table(storage: Storage, rank: int, step: int) -> dict[str, Any] | None:
    """Rank ``rank``'s entry table for ``step`` (not one of a dead-end snapshot, left by a failed
    execution of the step), or a "missing" answer."""
    table = _get(storage, *_stage(step, "plans", f"rank{rank}.json"))
    if table is not None and ("missing" in table or not _dead_end(storage, step, table.get("epoch"))):
        return table
    return _moved_on(storage, rank, step)


def _put_table(storage: Storage, step: int, rank: int, views: dict[int, SnapshotView]) -> None:
    _put(
        storage,
        {**plan_table(views[rank]), "first": min(views), "epoch": epoch_of(views[min(views)].info.header)},
        *_stage(step, "plans", f"rank{rank}.json"),
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
) -> dict[str, Any]:
    """Take part in persisting ``step`` with this node's ranks (``views``: rank → pinned snapshot).
    Every node must answer (its entry tables) within ``answer_s`` — a lost node must not hold up a
    save-on-failure for long — and the whole persist finish within ``timeout_s``. The coordinator asks
    the others for the step (``ask_others``) once the stage is clean. Returns the committed manifest;
    raises MissingSnapshot (``Abandoned``: a dead end), RuntimeError (aborted) or TimeoutError.
    ``on_planned(step)``: the coordinator's word that every node holds the step pinned (its table is in),
    so the rest of the persist can no longer lose it to a restarted worker's snapshot."""
    t0, deadline = time.perf_counter(), time.monotonic() + timeout_s
    epoch = epoch_of(views[min(views)].info.header)  # this node's snapshot of the step: what a dead end names
    if not coordinator:
        _raise_if_dead_end(storage, step, epoch)
    for r in views:  # nodes skip steps (a keeper that started late): whoever waits for us sees we moved on
        _put(storage, {"step": step, "epoch": epoch}, STAGE, "cursor", f"rank{r}.json")
    if coordinator:
        # A failed earlier attempt at this step (a table left by an execution that failed is a dead end).
        for name in ("go.json", "abort.json", "results"):
            _remove(storage, *_stage(step, name))
        storage.remove(step)
        if ask_others:
            request(storage, step)
    for r in views:
        _put_table(storage, step, r, views)
    if coordinator:
        return _coordinate(storage, step, views, world, source, t0, deadline, poll_s, answer_s, on_planned)
    return _participate(storage, step, views, t0, deadline, poll_s)


def abort(storage: Storage, step: int, reason: str) -> None:
    _put(storage, {"reason": reason, "time": time.time()}, *_stage(step, "abort.json"))


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
                    lambda r=r: _table(storage, r, step),
                )
                if "missing" in tables[r]:
                    raise MissingSnapshot(f"rank {r} does not hold step {step}: {tables[r]['missing']}")
        if on_planned is not None:
            on_planned(step)
        every = [views[r] if r in views else PlanOnlyView(tables[r]) for r in range(world)]
        planners, plans, metadata = global_plan(storage, step, every)
        attempt = uuid.uuid4().hex[:12]
        _put(
            storage,
            {"attempt": attempt, "plans": {str(r): plan_json(plans[r]) for r in range(world)}},
            *_stage(step, "go.json"),
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
            found = _get(storage, *_stage(step, "results", f"rank{r}.{attempt}.json"))
            if found is None:
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
    clear_stage(storage, below=step + 1)
    return manifest


def _participate(
    storage: Storage, step: int, views: dict[int, SnapshotView], t0: float, deadline: float, poll_s: float
) -> dict[str, Any]:
    epoch = epoch_of(views[min(views)].info.header)

    def go_or_replan() -> Any:
        if (stop := _get(storage, *_stage(step, "abort.json"))) is not None:  # before a re-put below
            raise RuntimeError(f"persist of step {step} aborted by the coordinator: {stop['reason']}")
        _raise_if_dead_end(storage, step, epoch)
        go = _get(storage, *_stage(step, "go.json"))
        if go is None and _moved_on(storage, 0, step):
            raise MissingSnapshot(f"the coordinator moved on past step {step}")
        for r in views:  # a coordinator that started later may have tidied the stage
            if go is None and not storage.fs.exists(storage.path(*_stage(step, "plans", f"rank{r}.json"))):
                _put_table(storage, step, r, views)
        return go

    go = _wait(storage, step, deadline, poll_s, "the coordinator's plan", go_or_replan)
    attempt = go["attempt"]
    hook = chaos_hook(step)
    with _Heartbeat(storage, step, min(views)):
        reports = _write_shares(storage, step, views, go, attempt, hook)
    # Only after the last beat: once every result is in, the coordinator commits and removes the stage,
    # and a beat still on its way would write it back (a stage directory left behind, seen under load).
    for r, report in reports.items():
        _put(storage, report, *_stage(step, "results", f"rank{r}.{attempt}.json"))

    def committed() -> dict[str, Any] | None:
        latest = storage.latest()
        return storage.manifest(step) if latest is not None and latest >= step else None

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
            _put(storage, {"error": repr(err)}, *_stage(step, "results", f"rank{r}.{attempt}.json"))
            raise
        reports[r] = {"results": results_json(results), "sums": sums}
    return reports


class _Heartbeat:
    """While a participant writes its shards, a counter in storage ticks every second, so the
    coordinator can tell a slow node (keep waiting) from a lost one (give up after ``answer_s``)."""

    def __init__(self, storage: Storage, step: int, first_rank: int) -> None:
        self.storage, self.parts = storage, _stage(step, "alive", f"rank{first_rank}.json")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="stalwart-persist-heartbeat", daemon=True)

    def _beat(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                _put(self.storage, {"beat": n}, *self.parts)
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
        beat = _get(self.storage, *_stage(self.step, "alive", f"rank{rank}.json"))
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or beat != last[0]:
            self.seen[rank] = (beat, now)
        elif now - last[1] > self.answer_s:
            raise TimeoutError(
                f"persist of step {self.step}: rank {rank}'s node stopped writing "
                f"(no heartbeat for {self.answer_s:.0f} s); its node is probably lost"
            )
