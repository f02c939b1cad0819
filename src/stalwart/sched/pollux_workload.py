"""The Pollux (OSDI'21) artifact's workloads and per-application measurements, as the cluster simulator
(``pollux_sim``) needs them (data: shipped in ``stalwart/sched/data/pollux``, see its PROVENANCE.md).

An application is what the artifact measured for one model: step and sync times per placement and
local batch (``placements.csv``, ``scalability.csv``), and, per global batch size it was trained at, a
validation curve per epoch (``validation-<batch>.csv``: cumulative progress, iterations, gradient
noise ``grad_sqr``/``grad_var``). Progress is counted in statistical-efficiency-weighted steps of the
smallest measured batch, so a job is done when its progress reaches what every batch size needed for
``max_epochs`` epochs, whatever batch sizes it ran at on the way.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

DEFAULT_ROOT = Path(__file__).resolve().parent / "data" / "pollux"  # package data

# Epochs each model trains for, and the local-batch cap, as the artifact's simulator sets them (its
# applications.py); everything else is read from the traces.
MAX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
MAX_LOCAL_BSZ = {"yolov3": 8}


@dataclass(frozen=True)
class WorkloadJob:
    """One row of ``workload-N.csv``: what the tuned (non-adaptive) baselines ask for."""

    name: str
    submit: float
    app: str
    num_replicas: int
    batch_size: int


@dataclass
class Application:
    """One model's measurements, with the interpolations the simulator treats as ground truth."""

    name: str
    validation: dict[int, dict[str, np.ndarray]]  # batch size -> column -> per-epoch values
    placements: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]  # bsz, step, sync
    grid: tuple[np.ndarray, np.ndarray]  # (nodes, replicas, local_bsz) points, (step, sync) values
    min_local_bsz: int
    max_local_bsz: int
    max_epochs: int
    _interp: object = field(default=None, repr=False)
    _memo: dict[tuple[tuple[int, ...], int], tuple[float, float]] = field(default_factory=dict, repr=False)

    @property
    def init_batch_size(self) -> int:
        return min(self.validation)

    @property
    def max_batch_size(self) -> int:
        return max(self.validation)

    @property
    def target_progress(self) -> float:
        """Progress at which a job is complete: the least any batch size needed for ``max_epochs``."""
        return self.progress_at(self.max_epochs)

    def progress_at(self, epoch: int) -> float:
        if epoch <= 0:
            return 0.0
        return float(min(v["progress"][epoch - 1] for v in self.validation.values()))

    def _bracket(self, batch: float) -> tuple[int, int, float]:
        sizes = sorted(self.validation)
        if not sizes[0] <= batch <= sizes[-1]:
            raise ValueError(f"{self.name}: batch {batch:g} outside the measured range [{sizes[0]}, {sizes[-1]}]")
        hi = next(s for s in sizes if s >= batch)
        lo = max(s for s in sizes if s <= batch)
        return lo, hi, 0.0 if hi == lo else (batch - lo) / (hi - lo)

    def _interp_column(self, column: str, batch: float, epoch: int) -> float:
        lo, hi, w = self._bracket(batch)
        epoch = min(epoch, self.max_epochs - 1)
        return float((1 - w) * self.validation[lo][column][epoch] + w * self.validation[hi][column][epoch])

    def grad_stats(self, batch: float, epoch: int) -> tuple[float, float]:
        """(|E g|², tr Σ) measured during ``epoch`` at global batch ``batch`` (linear in batch)."""
        return self._interp_column("grad_sqr", batch, epoch), self._interp_column("grad_var", batch, epoch)

    def iterations(self, batch: float, epoch: int) -> float:
        """Optimizer steps a job at ``batch`` has taken once it finished ``epoch`` (0-based)."""
        return self._interp_column("iteration", batch, epoch)

    def step_time(self, placement: tuple[int, ...], local_bsz: int) -> tuple[float, float]:
        """Measured (step, sync) seconds for replicas-per-node ``placement`` at ``local_bsz``: linear in
        the local batch for a measured placement, else linear over (nodes, replicas, local batch)."""
        placement = _canonical(placement)
        key = (placement, int(local_bsz))
        if key not in self._memo:
            self._memo[key] = self._lookup(placement, float(local_bsz))
        return self._memo[key]

    def _lookup(self, placement: tuple[int, ...], bsz: float) -> tuple[float, float]:
        if placement in self.placements:
            xs, step, sync = self.placements[placement]
            return float(np.interp(bsz, xs, step)), float(np.interp(bsz, xs, sync))
        if self._interp is None:
            from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

            points, values = self.grid
            self._interp = (LinearNDInterpolator(points, values), NearestNDInterpolator(points, values))
        linear, nearest = self._interp  # type: ignore[misc]
        query = np.array([[min(len(placement), 16), sum(placement), bsz]])
        out = linear(query)[0]
        if not np.all(np.isfinite(out)):  # outside the measured hull: the nearest measurement
            out = nearest(query)[0]
        return float(out[0]), float(out[1])


def _canonical(placement: tuple[int, ...]) -> tuple[int, ...]:
    """The lexicographically smallest rotation without empty nodes (how placements.csv names them)."""
    p = tuple(c for c in placement if c)
    if not p:
        raise ValueError("a placement needs at least one replica")
    return min(p[i:] + p[:i] for i in range(len(p)))


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@cache
def load_application(root: Path, name: str) -> Application:
    """One application's measurements under ``root/traces/<name>``; ValueError if missing."""
    folder = Path(root) / "traces" / name
    if not (folder / "placements.csv").exists():
        raise ValueError(f"no Pollux traces for {name!r}: expected {folder}/placements.csv")
    validation = {}
    for path in folder.glob("validation-*.csv"):
        rows = _read_csv(path)
        cols = ("progress", "iteration", "grad_sqr", "grad_var")
        validation[int(path.stem.split("-")[-1])] = {c: np.array([float(r[c]) for r in rows]) for c in cols}
    if not validation:
        raise ValueError(f"{folder} has no validation-<batch>.csv files")
    by_placement: dict[tuple[int, ...], list[tuple[float, float, float]]] = {}
    grid: dict[tuple[int, int, float], list[tuple[float, float]]] = {}
    for r in _read_csv(folder / "placements.csv"):
        p = tuple(int(c) for c in r["placement"])
        row = (float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"]))
        by_placement.setdefault(_canonical(p), []).append(row)
        grid.setdefault((len(p), sum(p), row[0]), []).append(row[1:])
    points = [list(k) for k in grid]
    values = [np.mean(v, axis=0).tolist() for v in grid.values()]
    if (folder / "scalability.csv").exists():
        for r in _read_csv(folder / "scalability.csv"):
            points.append([float(r["num_nodes"]), float(r["num_replicas"]), float(r["local_bsz"])])
            values.append([float(r["step_time"]), float(r["sync_time"])])
    placements = {}
    for p, rows in by_placement.items():
        arr = np.array(sorted(rows))
        placements[p] = (arr[:, 0], arr[:, 1], arr[:, 2])
    bsz = np.array([row[0] for rows in by_placement.values() for row in rows])
    max_epochs = min([MAX_EPOCHS.get(name, 10**9)] + [len(v["progress"]) for v in validation.values()])
    return Application(
        name=name,
        validation=dict(sorted(validation.items())),
        placements=placements,
        grid=(np.array(points), np.array(values)),
        min_local_bsz=int(bsz.min()),
        max_local_bsz=MAX_LOCAL_BSZ.get(name, int(bsz.max())),
        max_epochs=max_epochs,
    )


def workload_path(workload: str | int | Path, root: Path = DEFAULT_ROOT) -> Path:
    """``3`` or ``"3"`` -> ``root/workloads/workload-3.csv``; a path is taken as is."""
    if isinstance(workload, int) or (isinstance(workload, str) and workload.isdigit()):
        return Path(root) / "workloads" / f"workload-{int(workload)}.csv"
    return Path(workload)


def load_workload(workload: str | int | Path, root: Path = DEFAULT_ROOT) -> list[WorkloadJob]:
    """The jobs of a workload CSV (name,time,application,num_replicas,batch_size), by submit time."""
    path = workload_path(workload, root)
    if not path.exists():
        raise ValueError(f"no workload at {path}: pass 1..8 (with data under {root}) or a CSV path")
    jobs = []
    for i, r in enumerate(_read_csv(path)):
        try:
            job = WorkloadJob(
                r["name"], float(r["time"]), r["application"], int(r["num_replicas"]), int(r["batch_size"])
            )
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"{path} row {i + 2}: need columns name,time,application,num_replicas,batch_size ({err})"
            ) from err
        if job.num_replicas < 1 or job.batch_size < 1 or not math.isfinite(job.submit) or job.submit < 0:
            raise ValueError(f"{path} row {i + 2}: replicas and batch must be ≥ 1 and time ≥ 0, got {r}")
        jobs.append(job)
    if not jobs:
        raise ValueError(f"{path} has no jobs")
    return sorted(jobs, key=lambda j: j.submit)
