"""One Chrome-trace / Perfetto JSON for a whole job, from every rank's step records and the journal.

A track (process) per rank, named with its mesh coordinates ("rank 3 [dp1 pp0 tp1]") and ordered by
a view (``dp``, ``pp`` or ``tp`` first); each step is a complete event with its sections nested
inside (from the records' ``spans``, plus the checkpoint call at the step's end); the job's incidents
(fault, detected, stopped, restarted, first step), the master's decisions (evictions, restarts) and
rollbacks are instant events on a "job" track, each incident's recovery a complete event there.
Under pipeline parallelism each stage's forward of each micro-batch is a span (``pp_fwd_s<stage>``),
and flow arrows join stage S's forward of micro-batch k to stage S+1's (the activation send → recv).

Clocks: ranks on one host share a clock; between hosts ``clock_offsets`` estimates each host's offset
from rank 0's host as the median difference of the end of the step's gradient-norm all-reduce
(``grad_clip``, a collective over every rank: it ends at nearly the same instant everywhere), and the
export subtracts it. The estimates are in ``otherData.clock_offsets_ms``.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from stalwart.observe.records import STAGE_FORWARD

VIEWS = {"pp": ("pp", "dp", "tp"), "dp": ("dp", "pp", "tp"), "tp": ("tp", "pp", "dp")}
JOB_PID = 0  # the job's own track; rank R is pid R + 1
STAGE_SPAN = re.compile(STAGE_FORWARD.replace("{}", r"(\d+)"))  # a stage's forward of one micro-batch
SYNC_SECTION = "grad_clip"  # a collective over all ranks in every layout (the global gradient norm)


def track_name(rank: int, coords: dict[str, int]) -> str:
    inner = " ".join(f"{axis}{coords[axis]}" for axis in ("dp", "pp", "tp") if axis in coords)
    return f"rank {rank} [{inner}]" if inner else f"rank {rank}"


def _section_end(record: dict[str, Any], name: str) -> float | None:
    """Wall time (s) at which the record's last ``name`` span ended."""
    ends = [start + dur for span_name, start, dur in record.get("spans", []) if span_name == name]
    return record["time"] + max(ends) / 1e3 if ends and "time" in record else None


def clock_offsets(records: list[dict[str, Any]], meta: dict[int, dict[str, Any]]) -> dict[str, float]:
    """host → its clock minus the reference host's (rank 0's, else the lowest rank's), in seconds."""
    hosts = {rank: m.get("host", "") for rank, m in meta.items()}
    if len(set(hosts.values())) <= 1:
        return dict.fromkeys(set(hosts.values()), 0.0)
    ref_host = hosts[min(hosts)]
    ends: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))  # step → host → ends
    for r in records:
        end = _section_end(r, SYNC_SECTION)
        if end is not None and r.get("rank") in hosts:
            ends[r["step"]][hosts[r["rank"]]].append(end)
    deltas: dict[str, list[float]] = defaultdict(list)
    for by_host in ends.values():
        if ref_host not in by_host:
            continue
        ref = statistics.median(by_host[ref_host])
        for host, values in by_host.items():
            deltas[host].append(statistics.median(values) - ref)
    out = {host: statistics.median(d) for host, d in deltas.items()}
    for host in set(hosts.values()):
        out.setdefault(host, 0.0)  # no shared step with the reference: left as it is
    return out


def _order(meta: dict[int, dict[str, Any]], view: str) -> list[int]:
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; use one of {', '.join(VIEWS)}")
    axes = VIEWS[view]
    return sorted(meta, key=lambda r: (*(meta[r].get("coords", {}).get(a, 0) for a in axes), r))


def _rank_events(record: dict[str, Any], pid: int, us: Any) -> list[dict[str, Any]]:
    ms = record.get("ms", {})
    start = us(record["time"])
    step_us = ms.get("step", 0.0) * 1e3
    args = {k: record[k] for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mem_mb") if k in record}
    events = [{"name": f"step {record['step']}", "cat": "step", "ph": "X", "pid": pid, "tid": 0}]
    events[0].update(ts=start, dur=step_us, args={**args, "compute_ms": record.get("compute_ms")})
    for name, offset, dur in record.get("spans", []):
        events.append(
            {
                "name": name,
                "cat": "section",
                "ph": "X",
                "pid": pid,
                "tid": 0,
                "ts": start + offset * 1e3,
                "dur": dur * 1e3,
            }
        )
    if ms.get("checkpoint"):  # the snapshot call ends just before the step's end
        ckpt_us = ms["checkpoint"] * 1e3
        events.append(
            {"name": "checkpoint", "cat": "checkpoint", "ph": "X", "pid": pid, "tid": 0}
            | {"ts": start + step_us - ckpt_us, "dur": ckpt_us, "args": {"step": record["step"]}}
        )
    return events


def _stage_of(span_name: str) -> int | None:
    m = STAGE_SPAN.fullmatch(span_name)
    return int(m.group(1)) if m else None


def _flow_events(
    records: list[dict[str, Any]], meta: dict[int, dict[str, Any]], us_of: Callable[[int], Any]
) -> list[dict[str, Any]]:
    """Pipeline activation send → receive arrows: for each step and pipeline (same dp/tp coordinates),
    from the end of stage S's forward of micro-batch k to the start of stage S+1's."""
    forwards: dict[tuple[int, Any, Any, int], tuple[int, list[tuple[float, float]]]] = {}
    for r in records:
        coords = meta.get(r["rank"], {}).get("coords", {})
        for name, offset, dur in r.get("spans", []) if "time" in r else ():
            stage = _stage_of(name)
            if stage is not None:
                key = (r["step"], coords.get("dp"), coords.get("tp"), stage)
                start = us_of(r["rank"])(r["time"]) + offset * 1e3
                forwards.setdefault(key, (r["rank"], []))[1].append((start, dur * 1e3))
    events: list[dict[str, Any]] = []
    for (step, dp, tp, stage), (src, spans) in sorted(forwards.items(), key=lambda kv: kv[0][:1] + kv[0][3:]):
        dst_entry = forwards.get((step, dp, tp, stage + 1))
        if dst_entry is None:
            continue
        dst, dst_spans = dst_entry
        n = min(len(spans), len(dst_spans))  # from the end: a first step's shape inference adds a forward
        for mb, ((s_start, s_dur), (d_start, d_dur)) in enumerate(zip(spans[-n:], dst_spans[-n:])):
            flow = {"name": "activation", "cat": "pp", "id": len(events) // 2 + 1, "tid": 0}
            args = {"step": step, "microbatch": mb, "stage": f"{stage}→{stage + 1}"}
            events.append(flow | {"ph": "s", "pid": src + 1, "ts": s_start + s_dur - min(1.0, s_dur / 2), "args": args})
            events.append(flow | {"ph": "f", "bp": "e", "pid": dst + 1, "ts": d_start + min(1.0, d_dur / 2)})
    return events


def _instant(name: str, cat: str, t: float, us: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "i", "s": "g", "pid": JOB_PID, "tid": 0, "ts": us(t), "args": args}


def _job_events(
    incidents: list[dict[str, Any]],
    phases: tuple[str, ...],
    decisions: list[dict[str, Any]],
    rollbacks: list[dict[str, Any]],
    us: Any,
) -> list[dict[str, Any]]:
    events = []
    for inc in incidents:
        args = {"id": inc.get("id"), "node": inc.get("node_id"), "class": inc.get("class"), **inc.get("details", {})}
        times = [(phase, inc[phase]) for phase in phases if inc.get(phase)]
        for phase, t in times:
            events.append(_instant(f"{inc['kind']}: {phase}", "incident", t, us, args))
        if len(times) > 1:
            events.append(
                {"name": f"incident {inc.get('id')}: {inc['kind']}", "cat": "recovery", "ph": "X", "pid": JOB_PID}
                | {"tid": 1, "ts": us(times[0][1]), "dur": (times[-1][1] - times[0][1]) * 1e6, "args": args}
            )
    for d in decisions:
        events.append(
            _instant(
                f"decision: {d['action']}", "decision", d["ts"], us, {"reason": d.get("reason"), **d.get("details", {})}
            )
        )
    for rb in rollbacks:
        events.append(_instant("rollback", "rollback", rb["time"], us, rb))
    return events


def build_trace(
    records: list[dict[str, Any]],
    meta: dict[int, dict[str, Any]],
    incidents: Iterable[dict[str, Any]] = (),
    decisions: Iterable[dict[str, Any]] = (),
    rollbacks: Iterable[dict[str, Any]] = (),
    view: str = "pp",
    phases: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The trace as a JSON-able dict (``{"traceEvents": [...], "otherData": {...}}``); times are µs
    from the earliest event, on rank 0's host clock. ``phases``: the incident timestamps to show, in
    order (the journal's ``INCIDENT_TIMES``)."""
    incidents, decisions, rollbacks = list(incidents), list(decisions), list(rollbacks)
    meta = dict(meta)
    for r in records:  # a rank with records but no meta still gets a track
        meta.setdefault(r["rank"], {"rank": r["rank"], "coords": {}})
    offsets = clock_offsets(records, meta)
    host_of = {rank: m.get("host", "") for rank, m in meta.items()}
    times = [r["time"] - offsets.get(host_of.get(r["rank"], ""), 0.0) for r in records if "time" in r]
    times += [inc[p] for inc in incidents for p in phases if inc.get(p)]
    times += [d["ts"] for d in decisions] + [rb["time"] for rb in rollbacks]
    t0 = min(times) if times else 0.0

    def us_for(offset: float) -> Any:
        return lambda t: round((t - offset - t0) * 1e6, 3)

    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": JOB_PID, "tid": 0, "args": {"name": "job"}},
        {"name": "process_sort_index", "ph": "M", "pid": JOB_PID, "tid": 0, "args": {"sort_index": 0}},
        {"name": "thread_name", "ph": "M", "pid": JOB_PID, "tid": 1, "args": {"name": "recoveries"}},
    ]
    for index, rank in enumerate(_order(meta, view), 1):
        name = track_name(rank, meta[rank].get("coords", {}))
        events.append({"name": "process_name", "ph": "M", "pid": rank + 1, "tid": 0, "args": {"name": name}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank + 1, "tid": 0, "args": {"sort_index": index}}
        )

    def us_of(rank: int) -> Any:
        return us_for(offsets.get(host_of.get(rank, ""), 0.0))

    for r in records:
        if "time" in r:
            events += _rank_events(r, r["rank"] + 1, us_of(r["rank"]))
    events += _flow_events(records, meta, us_of)
    events += _job_events(incidents, phases, decisions, rollbacks, us_for(0.0))
    other = {"t0_unix_s": t0, "view": view, "clock_offsets_ms": {h: round(o * 1e3, 3) for h, o in offsets.items()}}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
