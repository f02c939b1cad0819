"""Measured step times from the Pollux artifact (``traces/<app>/``; shipped: ``DEFAULT_TRACES``, see
``data/pollux/PROVENANCE.md``) as ``throughput.Sample`` rows: ``placements.csv`` (a placement such as
``1124`` is four nodes holding 1, 1, 2 and 4 replicas) and ``scalability.csv`` (nodes, replicas)."""

from __future__ import annotations

import csv
from pathlib import Path

from stalwart.sched.throughput import Sample

APPS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")
DEFAULT_TRACES = Path(__file__).resolve().parent / "data" / "pollux" / "traces"  # package data


def load_app(root: str | Path, app: str) -> list[Sample]:
    """Every measurement of ``app`` under ``root`` (the folder holding ``<app>/placements.csv``)."""
    folder = Path(root) / app
    if not (folder / "placements.csv").exists():
        raise ValueError(f"no Pollux measurements for {app!r} under {root} (expected {folder}/placements.csv)")
    out = []
    with open(folder / "placements.csv") as f:
        for row in csv.DictReader(f):
            digits = [int(c) for c in row["placement"]]
            out.append(_sample(len(digits), sum(digits), row))
    scalability = folder / "scalability.csv"
    if scalability.exists():
        with open(scalability) as f:
            for row in csv.DictReader(f):
                out.append(_sample(int(row["num_nodes"]), int(row["num_replicas"]), row))
    return out


def _sample(nodes: int, replicas: int, row: dict[str, str]) -> Sample:
    return Sample(nodes, replicas, float(row["local_bsz"]), float(row["step_time"]), float(row["sync_time"]))
