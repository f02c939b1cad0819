"""Failure classes of a training job and published rates for them, for :mod:`stalwart.plan.simulate`.

A class fails at a constant rate per GPU, per node or per job (a size-independent source: the
scheduler, shared storage, a software bug that hits any run). What a failure costs depends on what
it destroys: ``evicts_node`` failures (a GPU or host fault) take the node and its shared memory with
them; ``hang`` failures are noticed by a timeout rather than a process exit.

Presets (rates per hour of one unit):

- ``llama3``: Llama 3 405B pre-training, 16,384 H100 for a 54-day snapshot, 419 unexpected
  interruptions (Dubey et al. 2024, Table 5), grouped into GPU (faulty GPU 148, HBM3 72, SRAM 19,
  system processor 17, SDC 6, thermal 6 = 268), host (maintenance 32, SSD 3, PSU 3, chassis 2, IO
  board 2, CPU 2, DRAM 2 = 46), network (switch/cable 35, NIC 7 = 42) and software (bugs 54, NCCL
  watchdog 7, dependency 2 = 63); divided by 16,384 GPUs (2,048 nodes) × 1,296 h.
- ``meta-rsc``: Meta's 2024 study of its research clusters (Kokolis et al., HPCA 2025) projects a
  job MTTF of ~7.9 h at 1,024 GPUs and ~1.8 h at 16,384. A per-node rate alone cannot give both
  (it would scale 16×, they scale 4.4×), so the preset solves for a per-node hardware rate
  (5.4 failures per 1,000 node-days; the paper's fitted r_f is 6.5 on RSC-1) plus a size-independent
  job-level rate (~0.1/h); these are derived from the two figures, which the simulation then re-measures.
"""

from __future__ import annotations

from dataclasses import dataclass

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class FailureClass:
    name: str
    per_hour: float  # failures per hour of one unit
    unit: str = "gpu"  # "gpu", "node" or "job"
    evicts_node: bool = False  # the node (and its shared-memory snapshots) is lost
    hang: bool = False  # detected by a timeout, not by a process exit

    def __post_init__(self) -> None:
        if self.unit not in ("gpu", "node", "job"):
            raise ValueError(f"failure class {self.name!r}: unit must be gpu, node or job, got {self.unit!r}")
        if self.per_hour < 0:
            raise ValueError(f"failure class {self.name!r}: rate must be >= 0 per hour, got {self.per_hour}")

    def job_rate(self, n_gpus: int, gpus_per_node: int = GPUS_PER_NODE) -> float:
        """Failures per hour of this class in a job of ``n_gpus``."""
        units = {"gpu": n_gpus, "node": -(-n_gpus // gpus_per_node), "job": 1}[self.unit]
        return self.per_hour * units


def _llama3() -> list[FailureClass]:
    gpu_hours = 16384 * 54 * 24
    return [
        FailureClass("gpu", 268 / gpu_hours, "gpu", evicts_node=True),
        FailureClass("host", 46 / gpu_hours, "gpu", evicts_node=True),
        FailureClass("network", 42 / gpu_hours, "gpu", hang=True),
        FailureClass("software", 63 / gpu_hours, "gpu"),
    ]


def _meta_rsc() -> list[FailureClass]:
    small, large, mttf_small, mttf_large = 1024, 16384, 7.9, 1.8
    per_gpu = (1 / mttf_large - 1 / mttf_small) / (large - small)
    per_job = 1 / mttf_small - per_gpu * small
    return [
        FailureClass("hardware", per_gpu * GPUS_PER_NODE, "node", evicts_node=True),
        FailureClass("job-level", per_job, "job"),
    ]


PRESETS = {"llama3": _llama3, "meta-rsc": _meta_rsc}
PUBLISHED = {
    "llama3": {"gpus": 16384, "days": 54, "interruptions": 419, "ettr_min": 0.90},
    "meta-rsc": {"mttf_hours": {1024: 7.9, 16384: 1.8}},
    "byterobust": {"gpus": 9600, "ettr": 0.97},
}


def preset(name: str) -> list[FailureClass]:
    if name not in PRESETS:
        raise ValueError(f"unknown failure preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()


def job_mttf_hours(classes: list[FailureClass], n_gpus: int, gpus_per_node: int = GPUS_PER_NODE) -> float:
    rate = sum(c.job_rate(n_gpus, gpus_per_node) for c in classes)
    if rate <= 0:
        raise ValueError("no failure class has a positive rate")
    return 1 / rate
