"""Materialise a model built on the meta device: only this rank's shards, each parameter initialised
from (seed, parameter name) alone.

    with torch.device("meta"):
        model = build_model(name, args)                  # no memory
    ... pipeline split, TP, EP, recompute, FSDP2 on meta ...
    materialize(model, parts, device, seed)              # to_empty + per-parameter init + buffers

The value of a parameter comes from ``model.initial_value(name, full_shape, dtype, seed)`` (a CPU
generator seeded by the run's seed and the parameter's name), so the weights are the same whatever
the world size or layout, and a 1-process run starts from exactly the weights of an 8-way FSDP2×TP run.

For a sharded parameter (FSDP2, TP, EP: a DTensor) the full tensor's values are generated on every
rank and this rank's shard is taken from them (``Replicate`` → the parameter's placements is a local
slice, no communication). This is done one parameter at a time, so the peak extra memory is one full
copy of the *largest single parameter* (the embedding or the LM head in practice), never the model:
a model larger than one rank's memory can be built as long as its largest tensor fits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from stalwart._compat import CHECKPOINT_WRAPPER_PREFIX


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` lives on the meta device (it needs ``materialize``)."""
    return any(p.device.type == "meta" for p in module.parameters())


def parameter_name(name: str) -> str:
    """The unsplit model's name of a parameter (activation recompute wrappers inserted a prefix)."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")


def materialize(
    model: nn.Module,
    parts: Iterable[nn.Module],
    device: torch.device,
    seed: int,
    buffer_device: torch.device | None = None,
) -> None:
    """Allocate ``model`` (and the pipeline stage modules ``parts``, which share its submodules) on
    ``device`` — only this rank's shards — then initialise every parameter from ``seed`` and its name
    and recompute the buffers, moved to ``buffer_device`` when given (FSDP2's CPU offload keeps the
    shards on the host but computes with the buffers on the GPU). ``model`` must have
    ``initial_value`` (``Transformer`` does)."""
    modules = [model, *(p for p in parts if p is not model)]
    for m in modules:  # every allocation first: a stage's to_empty must not wipe initialised weights
        m.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = model.initial_value(parameter_name(name), tuple(p.shape), p.dtype, seed).to(device)
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                full = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
                full = full.redistribute(mesh, p.placements)
                assert full.to_local().shape == p.to_local().shape, (name, full.placements, p.placements)
            p.copy_(full)
    for m in modules:
        for sub in m.modules():
            init = getattr(sub, "init_buffers", None)
            if callable(init):
                init()
            if buffer_device is not None and buffer_device != device:
                for key, buf in sub.named_buffers(recurse=False):
                    setattr(sub, key, buf.to(buffer_device))
