"""Tensor parallelism with sequence parallelism (Megatron-LM TP+SP) through DTensor
``parallelize_module``, applied to the unmodified LLaMA-style model (or a pipeline stage of it).

Between blocks the residual stream is a *local* tensor holding this rank's slice of the sequence
(``(batch, seq / tp, dim)``): norms run sequence-parallel, attention and MLP inputs are all-gathered
over the sequence, the column-parallel projections produce whole heads / hidden slices, and the
row-parallel output projections reduce-scatter back onto the sequence. Keeping the residual stream
local (not a DTensor) is what lets a pipeline stage send it to the next stage as a plain tensor.

A parallel block (``model.parallel_block``) is sharded so that TP communicates half as much: the
block's input stays a sequence-sharded DTensor, its one norm runs sequence-parallel and is gathered
once for both branches, both output projections leave *partial* sums, and the block's
``x + (attn + mlp)`` reduce-scatters their sum once. Backward mirrors it (one all-gather of the
output gradient, shared by both branches; one reduce-scatter of the norm output's gradient): 2
collectives forward and 2 backward per block instead of 4 and 4 (tests/unit/test_techniques_tp.py
counts them).

Loss parallel keeps the logits sharded on the vocabulary and computes the cross-entropy without
gathering them; it needs the loss to run under :func:`loss_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
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


def parallel_block_plan() -> dict[str, object]:
    """Plan for a parallel ``Block`` (no ``ffn_norm``): both branches leave partial sums, reduced once
    by the block's sum (see the module docstring; the gathers are hooks, :func:`_shard_parallel_block`)."""
    return {
        "attention_norm": SequenceParallel(),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        "feed_forward.w3": ColwiseParallel(),
    }


class _GatherGradOnce(torch.autograd.Function):
    """Identity forward; backward all-gathers the (sequence-sharded) output gradient to Replicate.
    Both branches of a parallel block receive the same gradient object: the second reuses the
    first's gather (``cache``, per block, emptied once used), so the block gathers it once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cache: dict[str, Any]) -> torch.Tensor:  # type: ignore[override]
        ctx.cache = cache
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        cache = ctx.cache
        if cache.get("grad") is grad:
            out = cache["out"]
            cache.clear()
        else:
            out = grad.redistribute(placements=[Replicate()])
            cache.update(grad=grad, out=out)
        return out, None


def _shard_parallel_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    # The block sees its input as a sequence-sharded DTensor (so x + partial sum is one reduce-scatter)
    # and returns a local tensor, like a serial block.
    parallelize_module(
        block,
        tp_mesh,
        PrepareModuleInputOutput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Shard(1), None),
            use_local_input=False,
            output_layouts=Shard(1),
            desired_output_layouts=Shard(1),
            use_local_output=True,
        ),
    )
    plan = parallel_block_plan()
    if getattr(block.feed_forward, "w3", None) is None:
        plan.pop("feed_forward.w3")
    parallelize_module(block, tp_mesh, plan)
    block.attention_norm.register_forward_hook(lambda _m, _i, out: out.redistribute(placements=[Replicate()]))
    cache: dict[str, Any] = {}
    for proj in (block.attention.wo, block.feed_forward.w2):
        proj.register_forward_hook(lambda _m, _i, out: _GatherGradOnce.apply(out, cache))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, use_loss_parallel: bool) -> bool:
    """Shard ``model`` (a Transformer or a pipeline stage with the same attribute names; absent parts
    may be None) over ``tp_mesh`` in place. Returns whether loss parallel is in effect."""
    check_tp_model(model, tp_mesh.size())
    root: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "embed_norm", None) is not None:
        root["embed_norm"] = SequenceParallel(use_local_output=True)
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
        if block.ffn_norm is None:
            _shard_parallel_block(block, tp_mesh)
            continue
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
