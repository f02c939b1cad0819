"""Hybrid parallelism from outside the model: one DeviceMesh with named axes, TP+SP, pipeline
(1F1B, interleaved 1F1B), MoE expert parallel, activation recompute, FSDP2/DDP with gradient
compression, for a given :class:`~stalwart.plan.parallel.Layout`. Entry point: :func:`parallelize`;
choosing the layout is the planner's (``stalwart.plan``), and from a config ``stalwart.train.resolve``
(see docs/parallelism.md)."""

from stalwart.plan.parallel import Layout
from stalwart.train.parallel.apply import ParallelModel, ParallelOptions, clip_grad_norm_, parallelize
from stalwart.train.parallel.mesh import Mesh, build_mesh, coords
from stalwart.train.parallel.pipeline import split_layers, stage_layers

__all__ = [
    "Layout",
    "Mesh",
    "ParallelModel",
    "ParallelOptions",
    "build_mesh",
    "clip_grad_norm_",
    "coords",
    "parallelize",
    "split_layers",
    "stage_layers",
]
