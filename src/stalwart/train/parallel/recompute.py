"""Activation recompute (checkpointing) applied from outside the model, per transformer block.

* ``full``: a block keeps only its input; its forward runs again during backward (Chen et al.
  2016). ``every=k`` wraps only every k-th block (torchtitan's layer-selective mode): memory and
  compute between none and full.
* ``selective``: op-level selective checkpointing (Korthikanti et al. 2022 in spirit): outputs of
  matrix multiplies, attention and collectives are saved, cheap element-wise ops (norms,
  activations, RoPE, residual adds) are recomputed. Saving the collectives' outputs also means the
  recomputation issues no communication.

Blocks are wrapped with ``checkpoint_wrapper`` (non-reentrant), which composes with DTensor TP,
FSDP2 and pipeline stages; the wrapper hides itself from ``state_dict`` so checkpoints keep the
model's own parameter names.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from stalwart._compat import checkpoint_wrapper

MODES = ("none", "selective", "full")


def _save_ops() -> set[object]:
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "linear",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_mm",
    ]
    ops: set[object] = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        for n in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "all_to_all_single"):
            if hasattr(functional, n):
                ops.add(getattr(functional, n).default)
    return ops


def _policy(save: set[object], ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[object, object]:
    """Context pair for ``torch.utils.checkpoint`` that saves matmul/attention/comm outputs."""
    return create_selective_checkpoint_contexts(partial(_policy, _save_ops()))


def apply_recompute(blocks: nn.ModuleDict, mode: str, every: int = 1) -> int:
    """Wrap the blocks of ``blocks`` (keyed by global layer index) in place; returns how many."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r} is not one of {', '.join(MODES)}")
    if every < 1:
        raise ValueError(f"recompute_every must be ≥ 1, got {every}")
    if mode == "none":
        return 0
    wrapped = 0
    for name, block in list(blocks.items()):
        if mode == "full":
            if int(name) % every:
                continue
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=selective_context)
        wrapped += 1
    return wrapped
