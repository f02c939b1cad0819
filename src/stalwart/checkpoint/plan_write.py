"""A plan's data in storage when the keepers act on the decider (docs/protocol.md, step 3):

    step-N/p{plan}/table.rank{r}.json        each node, before its Pinned: its ranks' entry tables
    step-N/__p{plan}a{attempt}_{r}_{i}.distcp each node, on Write: its ranks' share of DCP's layout
    step-N/p{plan}/a{attempt}.rank{r}.json    ... and their write results (sizes, CRCs)
    step-N/.metadata, manifest.json, latest  the committer, on Commit; then p{plan}/ goes

Every node plans the same layout from every rank's table (DCP's global plan is deterministic), so
nobody hands plans around; a late write of a plan given up or of an earlier attempt never overwrites
a shard the manifest names.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from stalwart._compat import storage_info, storage_info_fields, storage_prefix
from stalwart.checkpoint.persist import (
    PlanOnlyView,
    chaos_hook,
    commit,
    global_plan,
    json_bytes,
    plan_table,
    torch_save_without_crc,
    write_rank,
)
from stalwart.checkpoint.snapshot import SnapshotView
from stalwart.checkpoint.storage import Storage, step_name


def _put(storage: Storage, obj: Any, step: int, plan: int, name: str) -> None:
    parts = (step_name(step), f"p{plan}")
    if storage.local:
        storage.fs.makedirs(storage.path(*parts), exist_ok=True)
    storage.write_atomic(json_bytes(obj), *parts, name)


def _get(storage: Storage, step: int, plan: int, name: str, what: str) -> Any:
    text = storage.read_text(step_name(step), f"p{plan}", name)
    if not text:  # the decider's order says it is there: a storage that lost it failed the plan
        raise RuntimeError(f"step {step}, plan {plan}: {what} is not in storage ({name})")
    return json.loads(text)


def _table(storage: Storage, step: int, plan: int, rank: int) -> dict[str, Any]:
    return _get(storage, step, plan, f"table.rank{rank}.json", f"rank {rank}'s table")


def put_tables(storage: Storage, step: int, plan: int, views: dict[int, SnapshotView]) -> None:
    """Before this node's ``Pinned``: the entry tables of the ranks it writes (``views``: rank → pinned
    snapshot, its own or a peer copy of a lost node's rank)."""
    for rank, view in views.items():
        table = {**plan_table(view), "time": view.info.header["time"]}
        _put(storage, table, step, plan, f"table.rank{rank}.json")


def layout(
    storage: Storage, step: int, plan: int, attempt: int, world: int, views: dict[int, Any]
) -> tuple[list[Any], list[Any], Any]:
    """DCP's global plan of the step from every rank's table (``views``: this node's real snapshots,
    planned from the same entries): planners, each rank's plan named by the plan and attempt, and
    the metadata."""
    every = [views[r] if r in views else PlanOnlyView(_table(storage, step, plan, r)) for r in range(world)]
    planners, plans, metadata = global_plan(storage, step, every)
    prefix = f"__p{plan}a{attempt}_"
    named = [dataclasses.replace(p, storage_data=storage_prefix(f"{prefix}{r}_")) for r, p in enumerate(plans)]
    return planners, named, metadata


def write_share(
    storage: Storage, step: int, plan: int, attempt: int, world: int, views: dict[int, SnapshotView]
) -> None:
    """On ``Write``: this node's ranks' shards of the layout (fsynced), then their write results."""
    planners, plans, _ = layout(storage, step, plan, attempt, world, views)
    hook = chaos_hook(step)
    for rank in views:
        sums: dict[str, dict[str, int]] = {}
        with torch_save_without_crc():
            results = write_rank(storage, step, rank, planners[rank], plans[rank], sums, hook)
        _put(storage, {"results": results_json(results), "sums": sums}, step, plan, f"a{attempt}.rank{rank}.json")


def commit_plan(storage: Storage, step: int, plan: int, attempt: int, world: int, source: str) -> dict[str, Any]:
    """On ``Commit`` (every rank's results are in): ``.metadata`` → manifest → ``latest``; the plan's
    tables and results go (storage keeps the checkpoint only)."""
    t0 = time.perf_counter()
    tables = [_table(storage, step, plan, r) for r in range(world)]
    _, _, metadata = layout(storage, step, plan, attempt, world, {r: PlanOnlyView(t) for r, t in enumerate(tables)})
    results, sums = [], {}
    for r in range(world):
        done = _get(storage, step, plan, f"a{attempt}.rank{r}.json", f"rank {r}'s write results")
        results.append(results_from_json(done["results"]))
        sums.update(done["sums"])
    snapshot_time = max(float(t["time"]) for t in tables)
    manifest = commit(storage, step, metadata, results, sums, world, source, snapshot_time, t0)
    _remove(storage, step_name(step), f"p{plan}")
    return manifest


def remove_plan(storage: Storage, step: int, plan: int) -> None:
    """A plan given up: its tables, results and shards go — nothing of another plan of the same step (a
    save-on-failure may persist the step a lost node's plan could not). A write of it still under way
    may leave a file; the next keeper start removes an uncommitted step's directory."""
    _remove(storage, step_name(step), f"p{plan}")
    try:
        names = storage.fs.ls(storage.path(step_name(step)), detail=False)
    except FileNotFoundError:
        return
    for path in names:
        if path.rstrip("/").rsplit("/", 1)[-1].startswith(f"__p{plan}a"):
            _remove(storage, step_name(step), path.rstrip("/").rsplit("/", 1)[-1])


def _remove(storage: Storage, *parts: str) -> None:
    try:
        storage.fs.rm(storage.path(*parts), recursive=True)
    except FileNotFoundError:
        pass


def results_json(results: list[WriteResult]) -> list[dict[str, Any]]:
    """DCP write results as JSON: the committer never unpickles what another node wrote."""
    out = []
    for wr in results:
        out.append(
            {
                "fqn": wr.index.fqn,
                "offset": None if wr.index.offset is None else list(wr.index.offset),
                "index": wr.index.index,
                "size": wr.size_in_bytes,
                **storage_info_fields(wr.storage_data),
            }
        )
    return out


def results_from_json(items: list[dict[str, Any]]) -> list[WriteResult]:
    return [
        WriteResult(
            index=MetadataIndex(i["fqn"], i["offset"], i["index"]),
            size_in_bytes=i["size"],
            storage_data=storage_info(i),
        )
        for i in items
    ]
