"""`stalwart status`'s view of a job, from what the master knows (its status, live or rebuilt from the
journal) and what the ranks recorded (their step records, the run's summary.json)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from stalwart.observe.stragglers import scores

RECENT_STEPS = 10  # tokens/s and MFU: median over the newest records


def incident_row(inc: dict[str, Any]) -> dict[str, Any]:
    """An incident with its detection and recovery durations (s) and diagnosis line."""
    fault, detected, first = inc.get("fault"), inc.get("detected"), inc.get("first_step")
    details = inc.get("details") or {}
    diagnosis = (details.get("collectives") or {}).get("summary") or details.get("evidence") or ""
    return {
        "id": inc.get("id"),
        "kind": inc.get("kind"),
        "node": inc.get("node_id"),
        "ranks": details.get("ranks"),
        "fault": fault,
        "detect_s": detected - fault if fault and detected else None,
        "recover_s": first - fault if fault and first else None,
        "open": first is None,
        "diagnosis": str(diagnosis)[:2000],
    }


def _node_step(progress: dict[str, Any]) -> int | None:
    """The slowest rank's step on a node (its heartbeat's progress)."""
    steps = [r["step"] for r in progress.get("ranks", []) if r.get("step") is not None]
    return min(steps) if steps else None


def job_state(master: dict[str, Any] | None, live: bool, summary: dict[str, Any] | None) -> str:
    if summary is not None:
        return "finished"
    if master is None:
        return "unknown"
    incidents = master.get("incidents", [])
    if incidents and incidents[-1].get("first_step") is None:
        return "recovering" if live else "failed"
    return "running" if live else "stopped"


def build_status(
    master: dict[str, Any] | None,
    live: bool,
    records: list[dict[str, Any]],
    summary: dict[str, Any] | None = None,
    last_incidents: int = 5,
    stages: dict[int, int] | None = None,
) -> dict[str, Any]:
    """The status as one JSON-able dict (``stalwart status --json``). ``stages``: rank → pipeline
    stage, whose ranks are each other's straggler peers."""
    latest: dict[int, dict[str, Any]] = {}
    for r in records:
        if "time" in r and (r["rank"] not in latest or r["time"] >= latest[r["rank"]]["time"]):
            latest[r["rank"]] = r
    main = sorted(
        (r for r in records if r.get("rank") == min(latest, default=0) and "time" in r), key=lambda r: r["time"]
    )
    recent = main[-RECENT_STEPS:]
    tps = [r["tokens_per_s"] for r in recent if r.get("tokens_per_s")]
    mfu = [r["mfu"] for r in recent if r.get("mfu") is not None]
    now = time.time()
    out: dict[str, Any] = {
        "state": job_state(master, live, summary),
        "live": live,
        "step": max((r["step"] for r in latest.values()), default=None),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "mfu": statistics.median(mfu) if mfu else None,
        "loss": recent[-1].get("loss") if recent else None,
        "ranks": {
            rank: {"step": r["step"], "age_s": round(now - r["time"], 1), "step_ms": r.get("ms", {}).get("step")}
            for rank, r in sorted(latest.items())
        },
    }
    if records:  # rank → its slow compute sections; else the master's live view of the newest steps
        out["section_stragglers"] = scores(records, groups=stages)["flagged"]
    elif master is not None and master.get("section_stragglers"):
        out["section_stragglers"] = {int(r): s for r, s in master["section_stragglers"].items()}
    if master is not None:
        out["job_id"] = master.get("job_id")
        out["restarts_used"] = master.get("restarts_used")
        out["restart_budget"] = master.get("restart_budget")
        out["stragglers"] = master.get("stragglers", [])
        if (master.get("autoscale") or {}).get("best") is not None:
            out["autoscale"] = master["autoscale"]
        out["nodes"] = [
            {"node": n["node_id"], "host": n.get("host"), "state": n["state"], "nproc": n.get("nproc")}
            | {"heartbeat_age_s": round(now - n["last_heartbeat"], 1), "step": _node_step(n.get("progress") or {})}
            | {"workers": (n.get("progress") or {}).get("state")}
            for n in master.get("nodes", [])
        ]
        incidents = [incident_row(i) for i in master.get("incidents", [])]
        out["incidents"] = incidents[-last_incidents:]
        out["incident_count"] = len(incidents)
        hangs = [i for i in incidents if i["kind"] == "hang" and i["diagnosis"]]
        out["diagnosis"] = hangs[-1]["diagnosis"] if hangs and hangs[-1]["open"] else None
    if summary is not None and summary.get("checkpoint"):
        ck = summary["checkpoint"]
        out["checkpoint"] = {k: ck.get(k) for k in ("dir", "snapshots", "restored_from", "restore_step")}
    return out
