"""Hybrid parallelism from outside the model: one DeviceMesh with named axes, TP+SP, pipeline
(1F1B, interleaved 1F1B), MoE expert parallel, activation recompute, FSDP2/DDP with gradient
compression. Entry point: :func:`parallelize`; from the trainer's config: :func:`plan_parallel`
(see docs/parallelism.md)."""

from stalwart.train.parallel.apply import ParallelModel, ParallelOptions, clip_grad_norm_, parallelize
from stalwart.train.parallel.configure import ParallelPlan, plan_parallel, resolve_model_args
from stalwart.train.parallel.mesh import (CP_UNSUPPORTED, MESH_DIMS, AutoLayout, Layout, auto_layout,
                                          build_mesh, coords, layout_from_config)
from stalwart.train.parallel.pipeline import split_layers, stage_layers

__all__ = ["ParallelModel", "ParallelOptions", "clip_grad_norm_", "parallelize", "ParallelPlan", "plan_parallel",
           "resolve_model_args", "CP_UNSUPPORTED", "MESH_DIMS",
           "AutoLayout", "Layout", "auto_layout", "build_mesh", "coords", "layout_from_config", "split_layers",
           "stage_layers"]
