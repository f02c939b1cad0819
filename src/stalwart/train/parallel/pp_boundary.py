"""What crosses a pipeline stage boundary under TP (Falcon's pipeline scatter-gather; docs/techniques.md).

With tensor + sequence parallelism the residual stream between blocks is this rank's 1/tp slice of the
sequence, so a stage's TP rank r sends only its slice to the next stage's TP rank r, and the next
stage's first block all-gathers it over its TP group (the attention input's Shard(1) → Replicate):
that is Falcon's scatter-gather (Megatron's ``scatter_gather_tensors_in_pipeline``), and stalwart's
default (``parallel.pp_scatter_gather = true``).

``pp_scatter_gather = false`` is the plain send, kept as the baseline: a stage all-gathers its output
over TP and every TP rank sends the whole activation; the receiver keeps its own slice. The
arithmetic is the same (same losses); tp× the bytes go over the pipeline links.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def _gather(h: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence slice → the whole sequence (backward: this rank's slice of the gradient)."""
    return DTensor.from_local(h, mesh, [Shard(1)]).redistribute(mesh, [Replicate()]).to_local()


def _keep_slice(h: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence → this rank's slice (backward: the gradient all-gathered over TP)."""
    return DTensor.from_local(h, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def send_full_activations(stage: nn.Module, tp_mesh: DeviceMesh, first: bool, last: bool) -> None:
    """The plain send for one pipeline stage module: gather the output before it is sent (unless the
    last stage) and keep this rank's slice of what was received (unless the first stage)."""
    if not last:
        stage.register_forward_hook(lambda _m, _args, out: _gather(out, tp_mesh))
    if not first:

        def pre(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (_keep_slice(args[0], tp_mesh), *args[1:])

        stage.register_forward_pre_hook(pre)


class SentBytes:
    """Bytes this rank's pipeline stages posted to ``isend`` (activations forward, gradients backward):
    the tensors of the send ops the schedule fires, counted where the stage builds them."""

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0

    def watch(self, stage: Any) -> None:
        fwd, bwd = stage.get_fwd_send_ops, stage.get_bwd_send_ops

        def fwd_ops(*args: Any, **kwargs: Any) -> list[Any]:
            ops = fwd(*args, **kwargs)
            self.forward += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        def bwd_ops(*args: Any, **kwargs: Any) -> list[Any]:
            ops = bwd(*args, **kwargs)
            self.backward += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        stage.get_fwd_send_ops, stage.get_bwd_send_ops = fwd_ops, bwd_ops
