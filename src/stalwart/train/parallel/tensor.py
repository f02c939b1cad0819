"""Tensor parallelism with sequence parallelism (Megatron-LM TP+SP) through DTensor
``parallelize_module``, applied to the unmodified LLaMA-style model (or a pipeline stage of it).

Between blocks the residual stream is a *local* tensor holding this rank's slice of the sequence
(``(batch, seq / tp, dim)``): norms run sequence-parallel, attention and MLP inputs are all-gathered
over the sequence, the column-parallel projections produce whole heads / hidden slices, and the
row-parallel output projections reduce-scatter back onto the sequence. Keeping the residual stream
local (not a DTensor) is what lets a pipeline stage send it to the next stage as a plain tensor.

Loss parallel keeps the logits sharded on the vocabulary and computes the cross-entropy without
gathering them; it needs the loss to run under :func:`loss_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from stalwart.plan.parallel import Layout


def check_tp_model(model: nn.Module, tp: int) -> None:
    """Raise ValueError for model features the TP plan does not cover (see ``Layout.check_model``)."""
    args = getattr(model, "args", None)
    if args is not None:
        Layout(tp=tp).check_model(args)


def block_plan() -> dict[str, object]:
    """Plan for one transformer ``Block`` (keys relative to the block)."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, use_loss_parallel: bool) -> bool:
    """Shard ``model`` (a Transformer or a pipeline stage with the same attribute names; absent parts
    may be None) over ``tp_mesh`` in place. Returns whether loss parallel is in effect."""
    check_tp_model(model, tp_mesh.size())
    root: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        root["norm"] = SequenceParallel()
    has_head = getattr(model, "output", None) is not None
    if has_head:
        root["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if use_loss_parallel else Replicate(),
            use_local_output=not use_loss_parallel,
        )
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        plan = block_plan()
        if getattr(block.feed_forward, "w3", None) is None:
            plan.pop("feed_forward.w3")
        parallelize_module(block, tp_mesh, plan)
    return use_loss_parallel and has_head


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """Cross-entropy on vocabulary-sharded logits (the backward must run inside too)."""
    if enabled:
        with loss_parallel():
            yield
    else:
        yield
