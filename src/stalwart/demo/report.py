"""The demo's report: one entry per fault, from the master's journal and the trainer's step log.

Per incident and for the job (figures defined once, in ``stalwart.demo.recovery_metrics``):

  detected_s   fault → the agent noticed (signal / exit: ~immediately; hang: the --hang-timeout)
  mttr_s       fault → the first step completed after the restart
  regain_s     fault → the first completion of a step past the last one completed before the fault
  lost_steps   last step completed before the fault − the step the restart resumed from
  goodput      productive step time of the final trajectory ÷ wall time from starting the agents to
               their exit (start-up, restarts, recomputation and checkpoint calls are lost)
  stall_s      checkpoint time the training loop blocked on (pre-step hook waits + save calls) in the
               final attempt of rank 0 (the trainer reports per attempt)
  bitwise_equal  the final weights' hash equals that of a fault-free run with the same config and
               world size (computed once and cached in OUT_DIR/reference.json, keyed by the config)
"""

from __future__ import annotations

from typing import Any

from stalwart.demo.job import JobResult
from stalwart.demo.recovery_metrics import Recovery, StepRecord, goodput, recovery, split_at


def recoveries(incidents: list[dict[str, Any]], fault_rank: int | None = None) -> list[dict[str, Any]]:
    """One entry per fault. Every agent of a job reports the same fault (the peer of a killed rank
    sees a broken connection; a hang silences every rank), so incidents detected before the group's
    first step after restart belong together; the cause is the non-consequential one on the faulted
    rank, else the earliest; the fault time is the group's earliest."""
    groups: list[list[dict[str, Any]]] = []
    for inc in sorted((i for i in incidents if i["details"].get("source") != "worker"), key=lambda i: i["detected"]):
        recovered = min((i["first_step"] for i in groups[-1] if i["first_step"]), default=None) if groups else 0.0
        if groups and (recovered is None or inc["detected"] <= recovered):
            groups[-1].append(inc)
        else:
            groups.append([inc])
    out = []
    for group in groups:
        cause = min(
            group,
            key=lambda i: (
                bool(i["details"].get("consequential")),
                fault_rank not in i["details"].get("ranks", []),
                i["fault"] or i["detected"],
            ),
        )
        fault = min(i["fault"] or i["detected"] for i in group)
        first = min((i["first_step"] for i in group if i["first_step"]), default=None)
        out.append(
            {
                "kind": cause["kind"],
                "class": cause["class"],
                "node_id": cause["node_id"],
                "fault": fault,
                "detected": min(i["detected"] for i in group),
                "first_step": first,
                "last_step": max(i["details"].get("last_step", -1) for i in group),
            }
        )
    return out


def step_records(metrics: list[dict[str, Any]]) -> list[StepRecord]:
    """The trainer's ``metrics.jsonl`` records as the step log of ``recovery_metrics``. Its
    ``step_time_s`` includes the checkpoint save call and ``checkpoint_s`` is that call's part (0 in
    records of a run without checkpoints). A step whose checkpoint call failed (``interrupted``) is
    no completion: its time went into the failure."""
    done = [m for m in metrics if not m.get("interrupted")]
    return [StepRecord(m["step"], m["time"], m["step_time_s"], m.get("checkpoint_s", 0.0)) for m in done]


def recovery_of(metrics: list[dict[str, Any]], fault: float, detected: float, last_step: int) -> Recovery:
    """A fault's figures from the step log: completions after the detection belong to the restart."""
    before, after = split_at(step_records(metrics), detected)
    return recovery(before, after, fault, last_step=last_step)


def lost_steps(metrics: list[dict[str, Any]], detected: float, last_step: int) -> int | None:
    """``recovery_metrics``' lost steps: the last step completed before the fault was detected (logged,
    or reported to the agents) − the step the restart resumed from (the first one logged after the
    detection − 1)."""
    return recovery_of(metrics, detected, detected, last_step).lost_steps


def report(
    job: JobResult,
    injected: list[tuple[str, int]],
    reference_hash: str | None,
    reference_cached: bool,
    fault_rank: int | None = None,
) -> dict[str, Any]:
    incidents, unmatched = [], list(injected)
    for rec in recoveries(job.incidents, fault_rank):
        # Which injected fault this was: the one at the last step reported before it (an incident
        # nobody injected — a real one — stays unattributed instead of shifting the others).
        match = next((f for f in unmatched if abs(f[1] - rec["last_step"]) <= 1), None)
        if match is not None:
            unmatched.remove(match)
        action, step = match or (None, None)
        figures = recovery_of(job.metrics, rec["fault"], rec["detected"], rec["last_step"])
        incidents.append(
            {
                "kind": rec["kind"],
                "class": rec["class"],
                "injected": action,
                "at_step": step,
                "node_id": rec["node_id"],
                "detected_s": round(rec["detected"] - rec["fault"], 3),
                "mttr_s": _round(figures.mttr_s),
                "regain_s": _round(figures.regain_s),
                "lost_steps": figures.lost_steps,
            }
        )
    job_goodput = goodput(step_records(job.metrics), job.wall_s)
    summary = job.summary or {}
    ckpt = summary.get("checkpoint") or {}
    final_hash = summary.get("final_hash")
    return {
        "steps": summary.get("steps"),
        "wall_s": round(job.wall_s, 3),
        "restarts_used": job.restarts_used,
        "incidents": incidents,
        "goodput": round(job_goodput, 4) if job_goodput is not None else None,
        "stall_s": round(ckpt.get("hook_wait_s", 0.0) + ckpt.get("save_call_s", 0.0), 3),
        "final_hash": final_hash,
        "reference_hash": reference_hash,
        "reference_cached": reference_cached,
        "bitwise_equal": (final_hash == reference_hash) if reference_hash and final_hash else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
