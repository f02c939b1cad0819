"""Pairwise interference model for GPU sharing (issue 29): the throughput each of two jobs keeps when they
share a device, from the pair's features, fitted as MuxFlow fits its speed predictor: a small MLP.

Training data ships in ``stalwart/sched/data/interference`` (see its PROVENANCE.md):
  - ``cpu_pairs.csv``: pairs measured on this box by ``benchmarks/interference_pairs.py`` — two CPU jobs
    pinned to one core stand in for two kernels sharing a GPU's SMs (a stand-in: shapes, not sizes);
  - ``gavel_v100_pairs.csv``: Gavel's (OSDI'20) published space-sharing throughputs on one V100.
A domain input (1 for GPU data) lets one model learn from both; the simulator asks it with domain = 1.

Features of one job: model family (conv, transformer, rnn, embedding), log2 per-device batch, idle
fraction (the part of a step the device waits: input, host, communication; 1 - compute intensity) and
log10 bytes moved per flop (memory intensity; per family). The model predicts job A's normalised
throughput given partner B, so one pair gives two samples. Fitting is seeded and takes seconds on a CPU.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "interference"
FAMILIES = ("conv", "transformer", "rnn", "embedding")
# Bytes moved per flop of each family's kernel (benchmarks/interference_pairs.py's nominal counts at batch 32):
# the memory-intensity feature for jobs that were not measured on the CPU (GPU traces, Gavel's pairs).
FAMILY_BYTES_PER_FLOP = {"conv": 0.028, "transformer": 0.018, "rnn": 0.073, "embedding": 4.0}


@dataclass(frozen=True)
class JobFeatures:
    """What the model knows of one job."""

    family: str
    batch: float  # per device
    idle: float = 0.0  # fraction of a solo step the device is idle
    bytes_per_flop: float | None = None  # None: the family's nominal value

    def vector(self) -> list[float]:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; choose from {', '.join(FAMILIES)}")
        bpf = self.bytes_per_flop if self.bytes_per_flop is not None else FAMILY_BYTES_PER_FLOP[self.family]
        onehot = [1.0 if f == self.family else 0.0 for f in FAMILIES]
        return [*onehot, math.log2(max(self.batch, 1.0)) / 8.0, self.idle, math.log10(bpf)]


@dataclass(frozen=True)
class Pair:
    a: JobFeatures
    b: JobFeatures
    a_tput: float
    b_tput: float
    gpu: bool  # published GPU measurement (True) or the CPU stand-in


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def load_pairs(root: Path = DATA) -> list[Pair]:
    """Every measured pair: the CPU stand-in's, then Gavel's V100 ones."""
    pairs = []
    for r in _rows(root / "cpu_pairs.csv"):
        a, b = (
            JobFeatures(
                r[f"{s}_family"], float(r[f"{s}_batch"]), float(r[f"{s}_idle"]), float(r[f"{s}_bytes_per_flop"])
            )
            for s in "ab"
        )
        pairs.append(Pair(a, b, float(r["a_tput"]), float(r["b_tput"]), gpu=False))
    for r in _rows(root / "gavel_v100_pairs.csv"):
        a, b = (JobFeatures(r[f"{s}_family"], float(r[f"{s}_batch"])) for s in "ab")
        pairs.append(Pair(a, b, float(r["a_tput"]), float(r["b_tput"]), gpu=True))
    return pairs


def _samples(pairs: list[Pair]) -> tuple[np.ndarray, np.ndarray]:
    """Both orientations of each pair: (A's features, B's features, domain) -> A's throughput."""
    x, y = [], []
    for p in pairs:
        for me, other, t in ((p.a, p.b, p.a_tput), (p.b, p.a, p.b_tput)):
            x.append(me.vector() + other.vector() + [float(p.gpu)])
            y.append(min(max(t, 0.0), 1.2))
    return np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)


class InterferenceModel:
    """A fitted MLP, evaluated in numpy (the simulator asks it thousands of times)."""

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]], report: dict[str, float]) -> None:
        self.layers = layers
        self.report = report  # held-out error and what it was measured on
        self._memo: dict[tuple, tuple[float, float]] = {}

    def _forward(self, x: np.ndarray) -> np.ndarray:
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if i < len(self.layers) - 1:
                x = np.maximum(x, 0.0)
        return 1.2 / (1.0 + np.exp(-x[:, 0]))  # a throughput in (0, 1.2)

    def predict_batch(self, x: np.ndarray) -> np.ndarray:
        return self._forward(np.asarray(x, dtype=np.float64))

    def pair(self, a: JobFeatures, b: JobFeatures, gpu: bool = True) -> tuple[float, float]:
        """(A's, B's) normalised throughput when A and B share a device, each clipped to [0.02, 1]."""
        key = (a, b, gpu)
        if key not in self._memo:
            va, vb = a.vector(), b.vector()
            out = self._forward(np.array([va + vb + [float(gpu)], vb + va + [float(gpu)]]))
            self._memo[key] = (float(np.clip(out[0], 0.02, 1.0)), float(np.clip(out[1], 0.02, 1.0)))
        return self._memo[key]


def fit(
    pairs: list[Pair] | None = None,
    *,
    seed: int = 0,
    holdout: float = 0.2,
    hidden: int = 32,
    steps: int = 800,
) -> InterferenceModel:
    """Fit on all but a seeded ``holdout`` share of the pairs (both orientations of a held-back pair stay
    out), and report the held-out error (MAE, RMSE, and the MAE of predicting the training mean)."""
    import torch

    pairs = load_pairs() if pairs is None else pairs
    if not 0 < holdout < 1 or len(pairs) < 10:
        raise ValueError(f"need 0 < holdout < 1 and at least 10 pairs, got {holdout} and {len(pairs)}")
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_test = max(1, round(holdout * len(pairs)))
    test = [pairs[i] for i in order[:n_test]]
    train = [pairs[i] for i in order[n_test:]]
    x, y = _samples(train)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only spin (and the result stays bitwise the same)
    try:
        with torch.enable_grad():
            for _ in range(steps):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(1.2 * torch.sigmoid(net(xt)[:, 0]), yt)
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().double().numpy().T.copy(), m.bias.detach().double().numpy().copy()) for m in linears]
    model = InterferenceModel(layers, {})
    model.report = _report(model, train, test, float(y.mean()))
    return model


def _report(model: InterferenceModel, train: list[Pair], test: list[Pair], mean: float) -> dict[str, float]:
    out: dict[str, float] = {"train_pairs": len(train), "heldout_pairs": len(test)}
    for name, subset in (("", test), ("_gpu", [p for p in test if p.gpu]), ("_cpu", [p for p in test if not p.gpu])):
        if not subset:
            continue
        x, y = _samples(subset)
        err = model.predict_batch(x) - y
        out[f"heldout_mae{name}"] = float(np.abs(err).mean())
        out[f"heldout_rmse{name}"] = float(np.sqrt((err**2).mean()))
        out[f"mean_baseline_mae{name}"] = float(np.abs(mean - y).mean())
    x, y = _samples(train)
    out["train_mae"] = float(np.abs(model.predict_batch(x) - y).mean())
    return out


@cache
def default_model(seed: int = 0) -> InterferenceModel:
    """The model fitted on the shipped pairs (once per process and seed)."""
    return fit(seed=seed)
