"""``train.compile``: ``torch.compile`` per transformer block, applied from outside the model, and the
attention kernel a run really used.

Each block's ``forward`` is replaced by its compiled version (MegaScale fused LayerNorm and GeLU by
hand; inductor fuses norm, activation and the elementwise ops around the matmuls). Per block, not the
whole model: a recompile (a new shape, a guard that fails) stays local to one block's graph, and the
blocks share one graph (same code, parameters as inputs). Only ``forward`` is replaced: the module,
its hooks (FSDP2's unshard, recompute wrappers' own), its parameter names and so checkpoints are
untouched — a compiled run restores from and into the same state as an eager one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stalwart._compat import sdpa_backend
from stalwart.models import ModelArgs
from stalwart.models.llama import attention_mask


def compile_blocks(parts: list[nn.Module]) -> int:
    """Compile the forward of every block in every ``layers`` ModuleDict of ``parts`` (the model, or
    its pipeline stages, after parallelisation). Returns the number of blocks compiled."""
    n = 0
    for part in parts:
        for name, module in part.named_modules():
            if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleDict):
                for block in module.values():
                    block.forward = torch.compile(block.forward)
                    n += 1
    return n


def attention_backend(
    args: ModelArgs, micro_batch: int, seq_len: int, tp: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Which SDPA kernel the model's attention dispatches to: torch's choice for inputs of the model's
    shape, dtype and device (per-rank heads under TP), as the eager call makes it. Under
    ``train.compile`` inductor may lower attention itself; the record says so."""
    heads, kv = max(1, args.n_heads // tp), max(1, args.kv_heads // tp)
    q = torch.empty(micro_batch, heads, seq_len, args.head_dim, dtype=dtype, device=device)
    k = torch.empty(micro_batch, kv, seq_len, args.head_dim, dtype=dtype, device=device)
    mask = attention_mask(args, seq_len, device, dtype)  # the model's own: ALiBi, a window (no flash kernel)
    if mask is not None and mask.dim() == 3:  # ALiBi's per-head bias: this rank's heads under TP
        mask = mask[:heads]
    name = sdpa_backend(q, k, k, attn_mask=mask, is_causal=mask is None, enable_gqa=heads != kv)
    out: dict[str, Any] = {"backend": name, "how": "torch._fused_sdp_choice for the model's q/k/v"}
    if device.type == "cuda":
        b = torch.backends.cuda
        out["enabled"] = {
            "flash": b.flash_sdp_enabled(),
            "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(),
            "math": b.math_sdp_enabled(),
        }
    return out
