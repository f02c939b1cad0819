"""Training compute: FLOPs per token and derived figures (Kaplan et al. 2020; PaLM appendix B)."""

from __future__ import annotations


def flops_per_token(
    n_params: float,
    n_layers: int = 0,
    dim: int = 0,
    seq_len: int = 0,
    recompute: bool = False,
    attention: bool = True,
) -> float:
    """Training FLOPs per token: 6·N (forward 2·N + backward 4·N), 8·N with full activation
    recompute (one more forward), plus the attention score/value matmuls 12·L·h·s (PaLM) —
    16·L·h·s with recompute — when ``attention`` and the shape are given.
    """
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params}")
    factor = 8 if recompute else 6
    attn = 0.0
    if attention and n_layers and dim and seq_len:
        attn = 2 * factor * n_layers * dim * seq_len
    return factor * n_params + attn
