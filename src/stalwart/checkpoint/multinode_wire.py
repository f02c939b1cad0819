"""The multi-node protocol's DCP objects as JSON (:mod:`.multinode`): the keepers meet through files in
storage and never unpickle what another node wrote."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from stalwart._compat import storage_info, storage_info_fields, storage_prefix
from stalwart.checkpoint.persist import _SnapshotPlanner


def results_json(results: list[WriteResult]) -> list[dict[str, Any]]:
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


def plan_json(plan: SavePlan) -> dict[str, Any]:
    return {
        "prefix": plan.storage_data.prefix,
        "items": [
            [it.index.fqn, None if it.index.offset is None else list(it.index.offset), it.index.index]
            for it in plan.items
        ],
    }


def plan_from_json(planner: _SnapshotPlanner, data: dict[str, Any]) -> SavePlan:
    """This rank's share of the coordinator's global plan, rebuilt from its own local plan."""
    local = planner.create_local_plan()
    by_index = {(it.index.fqn, it.index.offset): it for it in local.items}
    items = []
    for fqn, offset, hint in data["items"]:
        index = MetadataIndex(fqn, offset, hint)
        items.append(dataclasses.replace(by_index[(fqn, index.offset)], index=index))
    return dataclasses.replace(local, items=items, storage_data=storage_prefix(data["prefix"]))
