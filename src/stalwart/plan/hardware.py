"""Accelerator table and cluster shape: the hardware figures every estimator divides by.

Figures are vendor datasheet values (dense, no sparsity, bf16/fp16 tensor cores). Memory is the
nominal GiB on the box (an "80 GB" A100 has 80 GiB = 85.9e9 bytes); the planner reports decimal GB
(1e9 bytes), so an A100-80G shows as 85.9 GB of capacity. Bandwidths are GB/s (1e9 bytes/s) per GPU
per direction: NVLink inside a node, the node's network share (NIC bandwidth ÷ GPUs per node) across
nodes. Any figure can be replaced by a raw number (``custom_gpu``, ``--gpu-flops``, ...).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, replace

GIB = 2**30
GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: float  # device memory
    peak_flops: float  # dense bf16 (fp16 on V100) tensor-core FLOP/s
    intra_node_gbps: float  # GB/s per GPU per direction over NVLink / the node fabric
    inter_node_gbps: float  # GB/s per GPU across nodes (node NIC bandwidth / GPUs per node)
    gpus_per_node: int = 8
    source: str = ""

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB


def _gpu(name: str, mem_gib: float, tflops: float, nvlink: float, net: float, per_node: int, source: str) -> GPUSpec:
    return GPUSpec(name, mem_gib * GIB, tflops * 1e12, nvlink, net, per_node, source)


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        _gpu("v100", 32, 125, 150, 12.5, 8, "V100-SXM2-32GB: 125 TFLOP/s fp16, NVLink2 300 GB/s bidir, EDR 100 Gb/s"),
        _gpu(
            "a100-40g",
            40,
            312,
            300,
            25,
            8,
            "A100-SXM4-40GB: 312 TFLOP/s bf16, NVLink3 600 GB/s bidir, HDR 200 Gb/s/GPU",
        ),
        _gpu(
            "a100-80g",
            80,
            312,
            300,
            25,
            8,
            "A100-SXM4-80GB: 312 TFLOP/s bf16, NVLink3 600 GB/s bidir, HDR 200 Gb/s/GPU",
        ),
        _gpu("h100", 80, 989, 450, 50, 8, "H100-SXM5-80GB: 989 TFLOP/s bf16, NVLink4 900 GB/s bidir, NDR 400 Gb/s/GPU"),
        _gpu(
            "h200", 141, 989, 450, 50, 8, "H200-SXM-141GB: 989 TFLOP/s bf16, NVLink4 900 GB/s bidir, NDR 400 Gb/s/GPU"
        ),
        _gpu("b200", 180, 2250, 900, 50, 8, "B200 (DGX B200, 180 GB each): 2.25 PFLOP/s bf16, NVLink5 1.8 TB/s bidir"),
        _gpu("mi300x", 192, 1307, 448, 50, 8, "MI300X-192GB: 1307 TFLOP/s bf16, Infinity Fabric 7x64 GB/s"),
        _gpu("l40s", 48, 362, 32, 25, 8, "L40S-48GB: 362 TFLOP/s bf16 dense, PCIe Gen4 x16 (no NVLink)"),
    )
}


def get_gpu(name: str) -> GPUSpec:
    key = name.lower().strip()
    if key in GPUS:
        return GPUS[key]
    close = difflib.get_close_matches(key, list(GPUS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown GPU {name!r}{hint}; known: {', '.join(GPUS)} — or give raw figures with --gpu-flops and --gpu-memory"
    )


def custom_gpu(
    base: GPUSpec | None = None,
    *,
    peak_flops: float | None = None,
    memory_gb: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    gpus_per_node: int | None = None,
) -> GPUSpec:
    """A GPU from raw numbers, starting from ``base`` (or from nothing: then flops and memory are
    required). Memory is in decimal GB here, as the user typed it."""
    if base is None:
        if peak_flops is None:
            raise ValueError("without --gpu NAME, give the peak FLOP/s with --gpu-flops (e.g. 989e12)")
        base = GPUSpec("custom", math.inf, peak_flops, 100.0, 25.0, 8, "raw numbers")
    changes: dict[str, object] = {}
    for key, value in (
        ("peak_flops", peak_flops),
        ("intra_node_gbps", intra_node_gbps),
        ("inter_node_gbps", inter_node_gbps),
        ("gpus_per_node", gpus_per_node),
    ):
        if value is not None:
            if value <= 0:
                raise ValueError(f"{key.replace('_', '-')} must be positive, got {value}")
            changes[key] = value
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"gpu-memory must be positive GB, got {memory_gb}")
        changes["memory_bytes"] = memory_gb * GB
    if changes and base.name != "custom":
        changes["name"] = f"{base.name}*"
    return replace(base, **changes) if changes else base


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` of one kind in nodes of ``gpu.gpus_per_node``."""

    gpu: GPUSpec
    n_gpus: int

    def __post_init__(self) -> None:
        if not isinstance(self.n_gpus, int) or self.n_gpus <= 0:
            raise ValueError(f"the number of GPUs must be a positive integer, got {self.n_gpus}")

    @property
    def gpus_per_node(self) -> int:
        return min(self.gpu.gpus_per_node, self.n_gpus)

    @property
    def n_nodes(self) -> int:
        return math.ceil(self.n_gpus / self.gpu.gpus_per_node)
