"""The optimizer (``optim.name``: AdamW, or LAMB for large batches) with decoupled weight decay on
matrices only, and a warmup + cosine LR schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from stalwart.config import TrainConfig
from stalwart.train.lamb import Lamb


def build_optimizer(model: nn.Module, cfg: TrainConfig, name: str = "adamw") -> torch.optim.Optimizer:
    """``name``: adamw | lamb (stalwart.train.lamb), both with [train]'s lr, betas, eps, weight_decay."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if name != "adamw":
        raise ValueError(f"optim.name={name!r} is not one of adamw, lamb")
    # foreach=True works for plain tensors and DTensors alike; fused kernels are CUDA-only here.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine decay to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
