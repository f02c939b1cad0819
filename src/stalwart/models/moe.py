"""Mixture-of-experts variant of the LLaMA-style decoder, in plain PyTorch.

Every ``moe_every``-th block's ``feed_forward`` becomes a :class:`MoEFeedForward`: a top-k softmax
router over ``num_experts`` SwiGLU experts whose weights are stored *batched* (one ``(E, ...)``
tensor per projection). Batched weights are what expert parallelism needs: EP shards dim 0 of each
tensor across ranks (``stalwart.train.parallel.expert``) and exchanges tokens with an all-to-all
around :class:`GroupedExperts`, without the model code knowing.

The Switch/GShard load-balancing loss ``E · Σ_e f_e · P_e`` is not returned through ``forward``
(that would break pipeline stages and activation recompute, which only see tensors flowing
through blocks); instead its gradient is injected into the backward pass at the block output
(:class:`_InjectAuxGrad`), scaled by ``aux_loss_coef × aux_grad_scale``. The training step sets
``aux_grad_scale`` to 1 / micro-batches (see :func:`set_aux_grad_scale`) so the objective is the
same mean over micro-batches whatever the layout. The last value is kept in ``last_aux_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.llama import ModelArgs, Transformer


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 4
    top_k: int = 2
    expert_hidden: int | None = None  # None → the dense model's ffn hidden size
    moe_every: int = 1  # block i is MoE when (i + 1) % moe_every == 0 (1 = every block)
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"moe.num_experts must be ≥ 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"need 1 ≤ moe.top_k ≤ moe.num_experts (got {self.top_k}, {self.num_experts})")
        if self.moe_every < 1:
            raise ValueError(f"moe.moe_every must be ≥ 1, got {self.moe_every}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"moe.aux_loss_coef must be ≥ 0, got {self.aux_loss_coef}")

    def is_moe_layer(self, i: int) -> bool:
        return (i + 1) % self.moe_every == 0


class GroupedExperts(nn.Module):
    """E SwiGLU experts as batched weights. Input rows are grouped by expert (``counts[e]`` rows
    for expert e, in order). Under EP the weights are DTensors sharded on dim 0 and the input holds
    only this rank's experts' rows; the forward then uses the local shard."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    @staticmethod
    def _local(p: torch.Tensor) -> torch.Tensor:
        to_local = getattr(p, "to_local", None)
        return to_local() if callable(to_local) else p

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._local(self.w1), self._local(self.w2), self._local(self.w3)
        sizes = [int(c) for c in counts.tolist()]
        if len(sizes) != w1.shape[0]:
            raise ValueError(f"got token counts for {len(sizes)} experts but hold {w1.shape[0]}")
        outs = []
        for e, chunk in enumerate(x.split(sizes)):
            # Every expert runs, even on zero rows, so every weight gets a (zero) gradient and
            # gradient hooks fire identically on every rank.
            h = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())
            outs.append(h @ w2[e].t())
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``x``; in backward, ``aux`` receives gradient ``scale`` (adds scale·aux to the
    objective without changing what forward returns)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class MoEFeedForward(nn.Module):
    """Top-k router + grouped experts; dropless (every token reaches its k experts)."""

    def __init__(self, args: ModelArgs, moe: MoEArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.coef = moe.num_experts, moe.top_k, moe.aux_loss_coef
        self.router = nn.Linear(args.dim, moe.num_experts, bias=False)
        self.experts = GroupedExperts(moe.num_experts, args.dim, moe.expert_hidden or args.hidden)
        self.aux_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k weights renormalised, top-k expert ids, load-balancing loss) for rows of x."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        frac = torch.bincount(ids.flatten(), minlength=self.num_experts).to(probs.dtype) / ids.numel()
        aux = self.num_experts * (frac * probs.mean(0)).sum()
        return weights.to(x.dtype), ids, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids, aux = self.route(flat)
        order = torch.argsort(ids.flatten(), stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        routed = self.experts(flat[order // self.top_k], counts)
        # Back to (token, k) order; index_select with the inverse permutation keeps autograd simple.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = routed.index_select(0, inverse).view(-1, self.top_k, shape[-1])
        out = (out * weights.unsqueeze(-1)).sum(1).view(shape)
        self.last_aux_loss = aux.detach()
        if self.coef > 0 and torch.is_grad_enabled():
            out = _InjectAuxGrad.apply(out, aux, self.coef * self.aux_grad_scale)
        return out


class MoETransformer(Transformer):
    """The dense decoder with MoE feed-forward blocks (same FQNs elsewhere, so the same TP/PP/FSDP
    code applies). ``feed_forward`` of a MoE block has ``router`` and ``experts``."""

    residual_suffixes = (*Transformer.residual_suffixes, "experts.w2")  # init as the dense model otherwise

    def __init__(self, args: ModelArgs, moe: MoEArgs) -> None:
        super().__init__(args)
        self.moe_args = moe
        for i, block in self.layers.items():
            if moe.is_moe_layer(int(i)):
                block.feed_forward = MoEFeedForward(args, moe)


def moe_modules(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """Weight of this forward's load-balancing loss in the objective (1 / micro-batches per step)."""
    for m in moe_modules(model):
        m.aux_grad_scale = scale


def aux_loss(model: nn.Module) -> float:
    """Mean load-balancing loss of the last forward over the MoE blocks on this rank (0 if none)."""
    values = [float(m.last_aux_loss) for m in moe_modules(model) if m.last_aux_loss is not None]
    return sum(values) / len(values) if values else 0.0
