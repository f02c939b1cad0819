"""Compute & time: the seed's published runs, the inverse questions, input errors."""

import math

import pytest

from stalwart.plan import compute
from stalwart.plan.compute import flops_per_token, gpus_for_days, tokens_for_days, total_flops, training_days


def days(n_params, tokens, gpus, flops, mfu):
    return training_days(total_flops(tokens, flops_per_token(n_params)), gpus, flops, mfu)


@pytest.mark.parametrize(
    "name,n_params,tokens,gpus,flops,mfu,published_days",
    [
        ("seed: 175B on 8192 H100", 175e9, 10e12, 8192, 1000e12, 0.5, 30),
        ("OPT-175B (achieved 147 TFLOP/s)", 175e9, 300e9, 992, 147e12, 1.0, 25),
        ("BLOOM-176B (achieved 150 TFLOP/s)", 176e9, 366e9, 384, 150e12, 1.0, 77),
        ("Falcon-180B", 180e9, 3.5e12, 4096, 312e12, 0.5, 68),
    ],
)
def test_published_runs(name, n_params, tokens, gpus, flops, mfu, published_days):
    assert days(n_params, tokens, gpus, flops, mfu) == pytest.approx(published_days, abs=1.0), name


def test_flops_per_token_terms():
    n, layers, dim, seq = 175e9, 96, 12288, 2048
    assert flops_per_token(n, attention=False) == 6 * n
    assert flops_per_token(n, recompute=True, attention=False) == 8 * n
    # PaLM appendix B: 6N + 12·L·h·s (16·L·h·s with one more forward)
    assert flops_per_token(n, layers, dim, seq) == 6 * n + 12 * layers * dim * seq
    assert flops_per_token(n, layers, dim, seq, recompute=True) == 8 * n + 16 * layers * dim * seq


def test_inverse_modes_round_trip():
    flops = total_flops(10e12, 6 * 175e9)
    n = gpus_for_days(flops, 30, 1000e12, 0.5, multiple=8)
    assert n % 8 == 0
    assert training_days(flops, n, 1000e12, 0.5) <= 30 < training_days(flops, n - 8, 1000e12, 0.5)
    tokens = tokens_for_days(30, 8192, 1000e12, 0.5, 6 * 175e9)
    assert training_days(total_flops(tokens, 6 * 175e9), 8192, 1000e12, 0.5) == pytest.approx(30)
    # hand: 30 d × 86400 s × 8192 × 1e15 × 0.5 / 1.05e12 FLOPs per token
    assert tokens == pytest.approx(30 * 86400 * 8192 * 1e15 * 0.5 / 1.05e12)


def test_chinchilla_default():
    assert compute.chinchilla_tokens(70e9) == pytest.approx(1.4e12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_gpus=-8, peak_flops=1e15, mfu=0.5), "GPUs"),
        (dict(n_gpus=8, peak_flops=1e15, mfu=1.2), "MFU"),
        (dict(n_gpus=8, peak_flops=1e15, mfu=0.0), "MFU"),
        (dict(n_gpus=8, peak_flops=-1.0, mfu=0.5), "FLOP/s"),
    ],
)
def test_invalid_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        training_days(1e24, **kwargs)
    with pytest.raises(ValueError):
        total_flops(-1, 6e9)
    assert math.isfinite(training_days(1e24, 8, 1e15, 0.5))
