"""Training compute: FLOPs per token, total FLOPs and wall-clock days, and the inverse questions
(how many GPUs for a deadline, how many tokens fit in one). Kaplan et al. 2020 (6·N), Hoffmann
et al. 2022 (20 tokens per parameter), PaLM appendix B (attention term)."""

from __future__ import annotations

import math

SECONDS_PER_DAY = 86400.0
CHINCHILLA_TOKENS_PER_PARAM = 20.0


def flops_per_token(
    n_params: float,
    n_layers: int = 0,
    dim: int = 0,
    seq_len: int = 0,
    recompute: bool = False,
    attention: bool = True,
    window: int = 0,
) -> float:
    """Training FLOPs per token: 6·N (forward 2·N + backward 4·N), 8·N with full activation
    recompute (one more forward), plus the attention score/value matmuls 12·L·h·s (PaLM) —
    16·L·h·s with recompute — when ``attention`` and the shape are given. With sliding-window
    attention (``window`` > 0) each query scores min(window, s) keys: s becomes min(window, s).
    """
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params}")
    factor = 8 if recompute else 6
    attn = 0.0
    if attention and n_layers and dim and seq_len:
        attn = 2 * factor * n_layers * dim * attended(seq_len, window)
    return factor * n_params + attn


def attended(seq_len: int, window: int = 0) -> int:
    """Keys each query is charged for in the attention FLOPs: the sequence, or the window if shorter."""
    return min(window, seq_len) if window > 0 else seq_len


def _check_run(n_gpus: float, peak_flops: float, mfu: float) -> None:
    if n_gpus <= 0:
        raise ValueError(f"the number of GPUs must be positive, got {n_gpus}")
    if peak_flops <= 0:
        raise ValueError(f"peak FLOP/s per GPU must be positive, got {peak_flops}")
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU is a fraction of peak in (0, 1], got {mfu}")


def total_flops(tokens: float, per_token: float) -> float:
    if tokens <= 0:
        raise ValueError(f"training tokens must be positive, got {tokens}")
    return tokens * per_token


def training_days(flops: float, n_gpus: float, peak_flops: float, mfu: float) -> float:
    """days = FLOPs ÷ (GPUs × peak FLOP/s × MFU) ÷ 86400. With an *achieved* FLOP/s per GPU
    (as papers report it), pass it as ``peak_flops`` with ``mfu=1``."""
    _check_run(n_gpus, peak_flops, mfu)
    return flops / (n_gpus * peak_flops * mfu) / SECONDS_PER_DAY


def gpus_for_days(flops: float, days: float, peak_flops: float, mfu: float, multiple: int = 1) -> int:
    """Fewest GPUs (rounded up to a multiple of ``multiple``, e.g. a node) that finish in ``days``."""
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    _check_run(1, peak_flops, mfu)
    exact = flops / (days * SECONDS_PER_DAY * peak_flops * mfu)
    return max(multiple, math.ceil(exact / multiple - 1e-9) * multiple)


def tokens_for_days(days: float, n_gpus: float, peak_flops: float, mfu: float, per_token: float) -> float:
    """Tokens that ``n_gpus`` can train on in ``days``."""
    if days <= 0:
        raise ValueError(f"days must be positive, got {days}")
    _check_run(n_gpus, peak_flops, mfu)
    return days * SECONDS_PER_DAY * n_gpus * peak_flops * mfu / per_token


def chinchilla_tokens(n_params: float) -> float:
    """Compute-optimal training tokens, ≈ 20 per parameter (Hoffmann et al. 2022)."""
    return CHINCHILLA_TOKENS_PER_PARAM * n_params
