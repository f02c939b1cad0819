"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2): Adam's update
scaled per parameter tensor by the trust ratio ‖x‖ / ‖r + λx‖, so that the global batch can grow
(MegaScale: 4×) without retuning the learning rate per layer.

    m ← β1·m + (1-β1)·g          v ← β2·v + (1-β2)·g²
    r = (m / (1-β1ᵗ)) / (sqrt(v / (1-β2ᵗ)) + ε)        u = r + λ·x
    x ← x - lr · φ(‖x‖) / ‖u‖ · u      φ = identity; the ratio is 1 when either norm is 0

The element-wise part runs on each rank's local shard; the two norms must be those of the *whole*
tensor, so under FSDP2/TP (DTensor parameters) each tensor's squared local norm is summed over the
mesh dimensions it is sharded on — one all-reduce per (mesh, sharded dims) group, not per tensor.
Under DDP and on one process the parameters are whole and no collective runs. The state (``step``,
``exp_avg``, ``exp_avg_sq``) is AdamW's, so checkpoints hold it in the same shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def global_sq_norms(tensors: Sequence[torch.Tensor], local: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Squared L2 norm of each full tensor (fp32, one entry per tensor), for plain tensors and
    DTensors sharded on any mesh: local sums, then all-reduced over each group's sharded mesh dims.
    ``local``: other values laid out like ``tensors``' local shards (e.g. updates) to take norms of."""
    if not tensors:
        return torch.zeros(0)
    values = local if local is not None else [_local(t) for t in tensors]
    sq = torch.stack([v.float().pow(2).sum() for v in values])
    groups: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor):
            assert not any(p.is_partial() for p in t.placements), "parameters are never partial"
            dims = tuple(d for d, p in enumerate(t.placements) if not p.is_replicate())
            if dims:
                groups.setdefault((t.device_mesh, dims), []).append(i)
    for (mesh, dims), idx in groups.items():
        # NCCL reduces device tensors only: an offloaded (host) optimizer still reduces on the device.
        part = sq[idx].to(mesh.device_type)
        for d in dims:
            dist.all_reduce(part, group=mesh.get_group(d))
        sq[idx] = part.to(sq.device)
    return sq


class Lamb(torch.optim.Optimizer):
    """LAMB with decoupled weight decay λ inside the trust-ratio update (the paper's form)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"LAMB needs lr, eps, weight_decay ≥ 0 and betas in [0, 1) (got {lr}, {eps}, {weight_decay}, {betas})"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            updates = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad
                if isinstance(grad, DTensor) and grad.placements != p.placements:  # e.g. TP's replicated head grad
                    grad = grad.redistribute(p.device_mesh, p.placements)
                g, m, v, x = (_local(a) for a in (grad, state["exp_avg"], state["exp_avg_sq"], p))
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                r = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt_().add_(group["eps"]))
                updates.append(r.add_(x, alpha=group["weight_decay"]) if group["weight_decay"] else r)
            w_norm = global_sq_norms(params).sqrt()
            u_norm = global_sq_norms(params, updates).sqrt()  # each update is sharded as its parameter
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm))
            for p, u, r in zip(params, updates, ratio.tolist()):
                _local(p).add_(u, alpha=-group["lr"] * r)
        return loss
