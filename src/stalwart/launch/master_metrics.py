"""Prometheus metric families of a job, read from the master's journal at scrape time.

No second copy of state: each scrape of ``GET /metrics`` reads the journal (and the straggler detector's
latest window) and yields the families below.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from stalwart.launch.autoscale import Recommendation
from stalwart.launch.master_state import MasterState


class JournalCollector:
    """A prometheus_client collector over one ``MasterState``."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        """Prometheus metric families, read from the journal at scrape time (no second copy of state)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        nodes = self.state.journal.nodes()
        by_state = GaugeMetricFamily("stalwart_nodes", "Nodes of the job by state", labels=["state"])
        for node_state in sorted({"alive", "lost", *(n["state"] for n in nodes)}):
            by_state.add_metric([node_state], sum(n["state"] == node_state for n in nodes))
        yield by_state
        yield GaugeMetricFamily(
            "stalwart_restarts_used",
            "Restarts spent from the job-wide budget",
            value=self.state.journal.get("restarts_used", 0),
        )
        yield GaugeMetricFamily(
            "stalwart_restart_budget",
            "Restarts allowed for the whole job",
            value=self.state.journal.get("restart_budget", 0),
        )
        incidents = CounterMetricFamily(
            "stalwart_incidents", "Journaled incidents by kind and class", labels=["kind", "class"]
        )
        counts = Counter((i["kind"], i["class"] or "") for i in self.state.journal.incidents())
        for (kind, cls), count in sorted(counts.items()):
            incidents.add_metric([kind, cls], count)
        yield incidents
        decisions = CounterMetricFamily("stalwart_decisions", "Journaled decisions by action", labels=["action"])
        for action, count in sorted(Counter(d["action"] for d in self.state.journal.decisions()).items()):
            decisions.add_metric([action], count)
        yield decisions
        steps = [r["step"] for n in nodes for r in n["progress"].get("ranks", []) if isinstance(r.get("step"), int)]
        yield GaugeMetricFamily(
            "stalwart_last_step", "Newest step any rank reported (-1 before the first)", value=max(steps, default=-1)
        )
        step_time = GaugeMetricFamily(
            "stalwart_step_compute_seconds",
            "Median over nodes of each node's median compute time per step in its last window",
        )
        if self.state.compute_s:
            step_time.add_metric([], statistics.median(self.state.compute_s.values()))
        yield step_time
        yield GaugeMetricFamily(
            "stalwart_stragglers", "Nodes flagged as stragglers", value=len(self.state.stragglers.flagged)
        )
        yield from _autoscale_families(self.state.autoscaler.latest)
        yield from _storage_families(nodes, time.time())
        yield GaugeMetricFamily(
            "stalwart_master_starts",
            "Times a master served this journal",
            value=self.state.journal.get("master_starts", 1),
        )


def _storage_families(nodes: list[dict[str, Any]], now: float) -> Iterator[Any]:
    """The checkpoint store as the nodes' keepers see it (heartbeat ``progress.storage``): the newest
    committed step, its age, failed persist attempts and whether storage is failing now."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    seen = [n["progress"]["storage"] for n in nodes if isinstance(n["progress"].get("storage"), dict)]
    committed = max((s.get("last_committed", -1) for s in seen), default=-1)
    times = [s["last_commit_time"] for s in seen if isinstance(s.get("last_commit_time"), (int, float))]
    yield GaugeMetricFamily(
        "stalwart_checkpoint_last_committed_step", "Newest step committed to storage (-1: none)", value=committed
    )
    age = GaugeMetricFamily(
        "stalwart_checkpoint_last_commit_age_seconds", "Seconds since the newest commit to storage (absent: none yet)"
    )
    if times:
        age.add_metric([], now - max(times))
    yield age
    yield CounterMetricFamily(
        "stalwart_checkpoint_persist_failures",
        "Failed attempts to write checkpoints to storage (persist, save-on-failure, retention)",
        value=sum(int(s.get("failures", 0)) for s in seen),
    )
    failing = GaugeMetricFamily(
        "stalwart_checkpoint_storage_failing", "1 while a node's persists fail, by cause", labels=["node", "cause"]
    )
    for n in nodes:
        s = n["progress"].get("storage")
        if isinstance(s, dict) and not s.get("ok", True):
            failing.add_metric([n["node_id"], str(s.get("cause"))], 1)
    yield failing


def _autoscale_families(rec: Recommendation | None) -> Iterator[Any]:
    """The live autoscaler's latest recommendation (absent before the first: every member needs a window)."""
    from prometheus_client.core import GaugeMetricFamily

    best = GaugeMetricFamily("stalwart_autoscale_recommended_nodes", "Node count the throughput model recommends")
    current = GaugeMetricFamily("stalwart_autoscale_current_nodes", "Nodes training when it recommended")
    gain = GaugeMetricFamily(
        "stalwart_autoscale_predicted_gain", "Predicted throughput of the recommended size over the current one, − 1"
    )
    if rec is not None:
        best.add_metric([], rec.best)
        current.add_metric([], rec.current)
        gain.add_metric([], rec.gain)
    yield from (best, current, gain)
