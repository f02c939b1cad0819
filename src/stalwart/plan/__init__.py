"""Planning estimators: pure functions, no torch.distributed.

compute (FLOPs, days), memory (per-GPU memory), layout (parallel layout search and step time),
reliability (failures, checkpoint interval, ETTR), hardware (GPU table), shape (parameter counts),
parallel (the one Layout type, and a Strategy: a Layout plus micro-batch/ZeRO/recompute), auto
(``parallel.layout = "auto"``: the fastest buildable layout and its explanation), api (everything at
once: ``plan(PlanInputs(...))``, the Python face of `stalwart plan`).
"""

from stalwart.plan.api import PlanInputs, plan
from stalwart.plan.auto import AutoLayout, auto_layout
from stalwart.plan.hardware import GPUS, Cluster, GPUSpec, custom_gpu, get_gpu
from stalwart.plan.layout import SearchResult, StepModel, search, step_time
from stalwart.plan.memory import ActivationOptions, MemoryBreakdown, MemoryOptions, Precision, memory_per_gpu
from stalwart.plan.parallel import CP_UNSUPPORTED, Layout, Strategy, layout_from_config
from stalwart.plan.shape import ModelShape, shape_for

__all__ = [
    "CP_UNSUPPORTED",
    "GPUS",
    "ActivationOptions",
    "AutoLayout",
    "Cluster",
    "GPUSpec",
    "Layout",
    "MemoryBreakdown",
    "MemoryOptions",
    "ModelShape",
    "PlanInputs",
    "Precision",
    "SearchResult",
    "StepModel",
    "Strategy",
    "auto_layout",
    "custom_gpu",
    "get_gpu",
    "layout_from_config",
    "memory_per_gpu",
    "plan",
    "search",
    "shape_for",
    "step_time",
]
