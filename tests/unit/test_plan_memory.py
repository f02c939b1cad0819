"""Memory per GPU: seed arithmetic, parameter accounting, Korthikanti closed forms, ZeRO/TP/PP/EP
sharding by hand, a published run, and the real trainer's peak (benchmarks/plan_memory.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.models import SPECS, ModelArgs, meta_param_count
from stalwart.plan.memory import (
    ActivationOptions,
    MemoryOptions,
    Precision,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    memory_per_gpu,
    min_nodes_for,
    model_state_bytes,
    stage_memory,
)
from stalwart.plan.parallel import Strategy, partition_layers
from stalwart.plan.shape import ModelShape, shape_for

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9


def test_seed_175b_state_and_nodes():
    assert model_state_bytes(175e9, 2) / GB == pytest.approx(350)  # bf16 weights
    assert model_state_bytes(175e9, 8) / GB == pytest.approx(1400)
    assert min_nodes_for(1400 * GB, 80 * GB, 8) == 3  # ≥ 3 nodes of 8 × 80 GB


@pytest.mark.parametrize("name", list(SPECS))
def test_parameter_accounting_matches_the_real_model(name):
    assert shape_for(name).total_params() == meta_param_count(SPECS[name].args)


def test_bloom_checkpoint_size_matches_published():
    # BigScience: bf16 weights 329 GB, full checkpoint with optimizer states 2.3 TB (binary units)
    n = shape_for("bloom-176b").total_params()
    assert n * 2 / 2**30 == pytest.approx(329, rel=0.01)
    assert n * Precision().checkpoint_bytes_per_param / 2**40 == pytest.approx(2.3, rel=0.05)


# Korthikanti et al. 2022, Table 2 forms for a GPT layer (GELU 4h, MHA, dropout, 16-bit),
# evaluated by hand for GPT-3 175B: s = 2048, b = 1, h = 12288, a = 96 → sbh = 25,165,824, 5as/h = 80.
GPT = ModelShape(
    "gpt",
    dim=12288,
    n_layers=96,
    n_heads=96,
    kv_heads=96,
    ffn_hidden=4 * 12288,
    vocab_size=50257,
    mlp="gelu",
    norm="layernorm",
    bias=True,
    tie_embeddings=True,
)
PAPER = ActivationOptions(sequence_parallel=False, flash_attention=False, dropout=True, fused_norm=True)


@pytest.mark.parametrize(
    "tp,sp,recompute,expected",
    [
        (1, False, "none", 25_165_824 * 114),  # sbh(34 + 5as/h)
        (8, False, "none", 25_165_824 * 23),  # sbh(10 + 24/t + 5as/(ht))
        (8, True, "none", 25_165_824 * 114 / 8),  # sbh(34 + 5as/h)/t
        (8, True, "selective", 25_165_824 * 34 / 8),  # sbh·34/t
        (8, False, "full", 2 * 25_165_824),  # 2sbh
    ],
)
def test_korthikanti_closed_forms(tp, sp, recompute, expected):
    opts = ActivationOptions(sequence_parallel=sp, flash_attention=False, dropout=True, fused_norm=True)
    got = layer_activation_bytes(GPT, 2048, 1, tp=tp, recompute=recompute, opts=opts, act_bytes=2)
    assert got == pytest.approx(expected)
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp, sp, recompute) == pytest.approx(expected)


def test_flash_attention_keeps_no_scores():
    opts = ActivationOptions(sequence_parallel=False, flash_attention=True, dropout=False)
    # 34 − 2 dropout masks = 32 sbh, plus the fp32 log-sum-exp (4 bytes × a × s × b)
    assert layer_activation_bytes(GPT, 2048, 1, opts=opts) == pytest.approx(25_165_824 * 32 + 4 * 96 * 2048)


# A tiny shape whose parameters are counted by hand: attention 4·64² = 16384, SwiGLU 3·64·256 =
# 49152, two RMSNorms 128 → 65664 per layer; embedding 6400; final norm + head 6464; total 144192.
TINY = ModelShape("tiny", dim=64, n_layers=2, n_heads=4, kv_heads=4, ffn_hidden=256, vocab_size=100)
N_TINY, LAYER, EMB, HEAD = 144_192, 65_664, 6_400, 6_464


def test_tiny_shape_count():
    assert TINY.total_params() == N_TINY
    assert meta_param_count(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=100, ffn_hidden=256)) == N_TINY


@pytest.mark.parametrize(
    "zero,weights,grads,optimizer",
    [
        (0, 2 * N_TINY, 2 * N_TINY, 12 * N_TINY),
        (1, 2 * N_TINY, 2 * N_TINY, 12 * N_TINY / 8),
        (2, 2 * N_TINY, 2 * N_TINY / 8, 12 * N_TINY / 8),
        (3, 2 * N_TINY / 8, 2 * N_TINY / 8, 12 * N_TINY / 8),
    ],
)
def test_zero_stages_by_hand(zero, weights, grads, optimizer):
    bd = memory_per_gpu(TINY, Strategy.of(dp=8, zero=zero), 64, 8)
    assert (bd.weights, bd.grads, bd.optimizer) == pytest.approx((weights, grads, optimizer))
    assert bd.zero3_buffers == (2 * LAYER * 2 if zero == 3 else 0)


def test_pipeline_and_tensor_sharding_by_hand():
    lay = Strategy.of(pp=2, zero=0)
    assert partition_layers(2, 2) == [1, 1]
    first = stage_memory(TINY, lay, 64, 4, 0)
    last = stage_memory(TINY, lay, 64, 4, 1)
    assert first.weights == 2 * (EMB + LAYER)  # embedding on the first stage
    assert last.weights == 2 * (LAYER + HEAD)  # final norm + LM head on the last
    tp2 = memory_per_gpu(TINY, Strategy.of(tp=2, zero=0), 64, 1)
    # matrices halve, the two norms per layer and the final norm stay whole
    assert tp2.weights == 2 * ((EMB + 6400) / 2 + 2 * ((16384 + 49152) / 2 + 128) + 64)


def test_first_stage_holds_more_micro_batches():
    # 1F1B: stage 0 keeps p micro-batches in flight, the last stage one (Narayanan et al. 2021)
    shape = ModelShape("even", dim=64, n_layers=4, n_heads=4, kv_heads=4, ffn_hidden=256, vocab_size=100)
    lay = Strategy.of(pp=4, zero=0)
    per_layer = layer_activation_bytes(shape, 64, 1, recompute="selective")
    assert stage_memory(shape, lay, 64, 8, 0).activations == pytest.approx(4 * per_layer)
    inter = Strategy.of(pp=4, zero=0, virtual_stages=2)
    assert stage_memory(shape, inter, 64, 8, 0).activations == pytest.approx(4 * per_layer * (1 + 3 / 8))


def test_moe_experts_shard_over_ep():
    moe = ModelShape(
        "moe",
        dim=64,
        n_layers=2,
        n_heads=4,
        kv_heads=4,
        ffn_hidden=256,
        vocab_size=100,
        num_experts=8,
        top_k=2,
        expert_hidden=128,
    )
    expert = 3 * 64 * 128
    dense = EMB + 2 * (16384 + 128 + 64 * 8) + HEAD
    assert moe.total_params() == dense + 2 * 8 * expert
    assert moe.active_params() == dense + 2 * 2 * expert
    bd = memory_per_gpu(moe, Strategy.of(dp=8, ep=4, zero=1), 64, 8)
    assert bd.weights == 2 * (dense + 2 * 2 * expert)  # 8 experts / ep 4 = 2 per GPU per layer
    assert bd.optimizer == pytest.approx(12 * (dense / 8 + 2 * 2 * expert / 2))  # experts: dp/ep = 2 replicas


def test_bloom_published_setting_fits_like_reported():
    # BLOOM: 8DP×12PP×4TP, ZeRO-1, micro-batch 2, full recompute, bf16 with fp32 grads, no SP/flash.
    # BigScience reported ~60 GB used per 80 GB GPU (allocator reserve included, so ≥ our tensor peak).
    opts = MemoryOptions(Precision(grad_bytes=4.0), ActivationOptions(sequence_parallel=False, flash_attention=False))
    bd = memory_per_gpu(
        shape_for("bloom-176b"), Strategy.of(8, 4, 12, micro_batch=2, zero=1, recompute="full"), 2048, 2048, opts
    )
    assert 0.5 * 60 < bd.total / GB < 1.1 * 60


def test_fp32_trainer_has_no_master_copy():
    p = Precision(4, 4, 0, 8, 4)
    assert p.state_bytes_per_param == 16 and p.checkpoint_bytes_per_param == 12
    with pytest.raises(ValueError):
        Precision(weight_bytes=-1)


def test_real_trainer_peak_within_20_percent():
    """benchmarks/plan_memory.py: predicted vs the CPU allocator's measured peak of the real trainer."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_memory.py"), "--configs", "debug", "--no-rss", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    row = result["models"]["debug"]
    assert row["measured_mb"] > 0
    assert abs(row["ratio"] - 1) <= 0.20, row
