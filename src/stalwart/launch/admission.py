"""A node's admission before each rendezvous: its precheck (burn-in of its devices), judged by the master,
which also compares nodes and journals it; without a master the local verdict holds."""

from __future__ import annotations

import logging
from typing import Any

from stalwart.health.precheck import PrecheckConfig, run_precheck
from stalwart.launch.client import MasterClient, MasterError

log = logging.getLogger("stalwart.agent")


def precheck_refusal(
    master: MasterClient, node_id: str, local_world_size: int, config: PrecheckConfig, results: list[dict[str, Any]]
) -> str | None:
    """Run the precheck (appending its result to ``results``); the reason this node may not join, or None."""
    result = run_precheck(local_world_size, config)
    results.append(result.to_json())
    log.info(
        "precheck: %s in %.2f s (matmul %.2f ms)%s",
        "ok" if result.ok else "FAILED",
        result.seconds,
        result.matmul_s * 1e3,
        f": {'; '.join(result.reasons)}" if result.reasons else "",
    )
    try:
        verdict = master.call("POST", "/v1/nodes/precheck", {"node_id": node_id, **result.to_json()})
    except (MasterError, OSError) as err:
        log.error("no precheck verdict from the master (%s); judging locally", err)
        verdict = {"admit": result.ok, "reason": f"precheck failed: {'; '.join(result.reasons)}"}
    if verdict.get("admit", result.ok):
        return None
    return str(verdict.get("reason") or "the master did not admit this node after its precheck")
