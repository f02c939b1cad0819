"""Per-node and per-rank step/section histograms (ms buckets) on the master's ``/metrics``, from the
histograms each node's heartbeat carries (``stalwart.observe.histo``; stored with the node's
progress in the journal, so a restarted master exports them too), and the journal's incidents as
detection and recovery time histograms (s)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stalwart.observe.histo import BUCKETS_MS, cumulative

RECOVERY_BUCKETS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
RANK_FAMILY = "stalwart_rank_section_ms"
NODE_FAMILY = "stalwart_node_section_ms"


def _merge(into: dict[str, Any], h: dict[str, Any]) -> None:
    counts = into.setdefault("counts", [0] * (len(BUCKETS_MS) + 1))
    for i, n in enumerate(h["counts"]):
        counts[i] += n
    into["sum"] = into.get("sum", 0.0) + h["sum"]


class SectionHistogramCollector:
    """A prometheus_client collector over ``nodes()`` (the journal's node rows)."""

    def __init__(self, nodes: Any, incidents: Any = list) -> None:
        self.nodes, self.incidents = nodes, incidents

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily

        per_rank = HistogramMetricFamily(
            RANK_FAMILY, "Step and section times of each rank, ms (section=step: the whole step)",
            labels=["node", "rank", "section"],
        )  # fmt: skip
        per_node = HistogramMetricFamily(
            NODE_FAMILY, "Step and section times over a node's ranks, ms", labels=["node", "section"]
        )
        for node in self.nodes():
            merged: dict[str, dict[str, Any]] = {}
            hist = (node.get("progress") or {}).get("hist") or {}
            for rank, body in sorted(hist.items(), key=lambda kv: int(kv[0])):
                if list(body.get("buckets_ms", [])) != list(BUCKETS_MS):
                    continue  # another version's buckets: not comparable
                for section, h in sorted(body["sections"].items()):
                    per_rank.add_metric([node["node_id"], str(rank), section], cumulative(h["counts"]), h["sum"])
                    _merge(merged.setdefault(section, {}), h)
            for section, h in sorted(merged.items()):
                per_node.add_metric([node["node_id"], section], cumulative(h["counts"]), h["sum"])
        yield per_rank
        yield per_node
        yield from self._recoveries(HistogramMetricFamily)

    def _recoveries(self, family: Any) -> Iterator[Any]:
        """Fault → detected and fault → first step after the restart, over the journal's incidents."""
        spans = {"detection": ("fault", "detected"), "recovery": ("fault", "first_step")}
        for what, (begin, end) in spans.items():
            values = [i[end] - i[begin] for i in self.incidents() if i.get(begin) and i.get(end)]
            counts = [sum(1 for v in values if v <= b) for b in RECOVERY_BUCKETS_S] + [len(values)]
            h = family(f"stalwart_incident_{what}_seconds", f"Incidents' {what} times (s), from the journal")
            h.add_metric([], [(str(b), c) for b, c in zip([*RECOVERY_BUCKETS_S, "+Inf"], counts)], sum(values))
            yield h
