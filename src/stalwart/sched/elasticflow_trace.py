"""ElasticFlow (ASPLOS'23) ITP traces and A100 throughput tables (shipped in ``stalwart/sched/data/elasticflow``,
see its PROVENANCE.md): what ``stalwart sim`` replays to compare deadline-aware schedulers against the
paper's Fig. 8b. A trace is ``traces/<name>.csv`` or, as shipped, ``traces/<name>.csv.gz``."""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

DEFAULT_DATA_ROOT = Path(__file__).resolve().parent / "data" / "elasticflow"  # package data
GPUS_PER_NODE = 8
# The paper's cluster sizes per trace (run_fig8b.sh: n64g8, n128g8, n32g8).
CLUSTER_GPUS: dict[str, int] = {
    **{f"cluster{i:02d}": 512 for i in (1, 2, 3, 5, 6)},
    **{f"cluster{i:02d}": 1024 for i in (4, 7, 8, 9)},
    "cluster10": 256,
}
TRACE_COLUMNS = ("job_id", "submission_time", "num_iteration", "model_name", "deadline", "batch_size", "num_gpu")


@dataclass(frozen=True)
class TraceJob:
    """One trace row. ``duration`` is the run time (s) at ``num_gpu`` GPUs, which fixed-size schedulers
    (Tiresias, FIFO) replay; elastic ones work from ``iterations`` and the throughput table."""

    name: str
    submit: float
    iterations: float
    model: str
    deadline: float
    batch_size: int
    num_gpu: int
    duration: float


@dataclass(frozen=True)
class Scaling:
    """Throughput (iterations/s) of one (model, global batch) at each profiled GPU count.
    ``levels`` are the usable power-of-two GPU counts, ascending; ``rate[g]`` is the throughput at
    exactly ``g`` GPUs (0 where ``g`` is not a level) and ``down[f]`` the largest level <= f (0 if none),
    both indexed 0..cluster GPUs so a plan can look whole arrays up at once."""

    levels: np.ndarray
    rate: np.ndarray
    down: np.ndarray

    @property
    def max_level(self) -> int:
        return int(self.levels[-1])


def resolve_trace(trace: str | Path, data_root: Path = DEFAULT_DATA_ROOT) -> Path:
    """A trace name (``cluster04``: ``traces/cluster04.csv``, else ``.csv.gz``, under ``data_root``) or
    path to its CSV file (``.csv`` or ``.csv.gz``)."""
    path = Path(trace)
    if path.name.endswith((".csv", ".csv.gz")):
        if not path.exists():
            raise ValueError(f"no ElasticFlow trace {trace!r}: {path} does not exist")
        return path
    folder = Path(data_root) / "traces"
    for path in (folder / f"{trace}.csv", folder / f"{trace}.csv.gz"):
        if path.exists():
            return path
    raise ValueError(
        f"no ElasticFlow trace {trace!r}: neither {trace}.csv nor {trace}.csv.gz in {folder} "
        f"(names: {', '.join(CLUSTER_GPUS)})"
    )


def trace_name(trace: str | Path) -> str:
    """``cluster04`` for ``cluster04``, ``.../cluster04.csv`` or ``.../cluster04.csv.gz``."""
    return Path(trace).name.removesuffix(".gz").removesuffix(".csv")


def cluster_gpus(trace: str | Path) -> int:
    """The paper's cluster size for a named trace; pass ``gpus=`` explicitly for other traces."""
    name = trace_name(trace)
    if name not in CLUSTER_GPUS:
        raise ValueError(f"no published cluster size for trace {name!r}; pass gpus= (known: {', '.join(CLUSTER_GPUS)})")
    return CLUSTER_GPUS[name]


def load_trace(trace: str | Path, data_root: Path = DEFAULT_DATA_ROOT) -> list[TraceJob]:
    """Rows of a trace sorted by submission time (stable, so ties keep file order)."""
    path = resolve_trace(trace, data_root)
    with gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} lacks columns {missing}; expected {', '.join(TRACE_COLUMNS)}")
        jobs = []
        for line, row in enumerate(reader, start=2):
            try:
                gpus = int(row["num_gpu"])
                iterations = float(row["num_iteration"])
                duration = float(row["duration"]) if row.get("duration") else float("nan")
                jobs.append(
                    TraceJob(
                        name=row["job_id"],
                        submit=float(row["submission_time"]),
                        iterations=iterations,
                        model=row["model_name"],
                        deadline=float(row["deadline"]),
                        batch_size=int(row["batch_size"]),
                        num_gpu=gpus,
                        duration=duration,
                    )
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: bad row {row}: {exc}") from exc
    jobs.sort(key=lambda j: j.submit)
    return jobs


@cache
def _table(data_root: Path, model: str) -> dict[int, dict[int, float]]:
    path = Path(data_root) / "throughputs_A100" / f"{model}.csv"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.csv"))
        raise ValueError(f"unknown model {model!r}: no {path} (known: {', '.join(known) or 'none'})")
    out: dict[int, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            batch = int(row.pop("global_batch_size"))
            out[batch] = {int(g): float(v) for g, v in row.items() if v not in ("", "nan") and float(v) > 0}
    return out


def load_throughputs(data_root: Path, model: str) -> dict[int, dict[int, float]]:
    """``{global batch: {GPUs: iterations/s}}`` for one model (missing or zero cells dropped)."""
    return _table(Path(data_root), model)


@cache
def _scaling(data_root: Path, model: str, batch: int, cap: int, gpus: int) -> Scaling:
    table = _table(data_root, model)
    if batch not in table:
        raise ValueError(f"no throughput for {model} at global batch {batch} (have {sorted(table)})")
    levels = np.array(sorted(g for g in table[batch] if g <= min(cap, gpus)), dtype=np.int64)
    if len(levels) == 0:
        raise ValueError(f"{model} at batch {batch} has no profiled GPU count <= {min(cap, gpus)}")
    rate = np.zeros(gpus + 1)
    rate[levels] = [table[batch][int(g)] for g in levels]
    down = np.zeros(gpus + 1, dtype=np.int64)
    for g in levels:
        down[g:] = g
    return Scaling(levels, rate, down)


def scaling(data_root: Path, model: str, batch: int, cap: int, gpus: int) -> Scaling:
    """The usable levels of (model, batch) on a ``gpus``-GPU cluster, capped at ``cap`` GPUs per job."""
    return _scaling(Path(data_root), model, batch, cap, gpus)


def elastic_cap(model: str, batch: int) -> int:
    """The per-job GPU cap ElasticFlow's simulator applies to elastic jobs (models.get_max_gpu, A100):
    past it the profiled scaling flattens or was never measured."""
    caps = {("bert", 64): 8, ("bert", 128): 16, ("gpt2", 128): 16, ("gpt2", 256): 32, ("inception3", 64): 16}
    caps |= {("inception3", 128): 32, ("resnet50", 64): 32, ("vgg16", 64): 32}
    if model == "deepspeech2":
        return batch
    if (model, batch) in caps:
        return caps[(model, batch)]
    return 16 if model == "bert" else min(batch, 64)


def fixed_cap(batch: int) -> int:
    """The cap for non-elastic baselines (EDF): the largest profiled count, at most 64 and the batch."""
    return min(batch, 64)
