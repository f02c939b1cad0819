"""Issue 28's model and optimizer techniques in one process: sliding-window attention against an
explicit masked softmax, the parallel block and the embedding norm against their formulas, LAMB
against a plain reading of the paper, and what the planner makes of each. The multi-process checks
(TP2 collectives and losses, FSDP2/DDP LAMB, CPU offload, resume) are tests/e2e/test_techniques.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stalwart.config import load_config
from stalwart.models import Transformer, model_args
from stalwart.models.llama import Attention, Block, ModelArgs, apply_rope, rope_tables
from stalwart.models.registry import meta_param_count
from stalwart.plan import Cluster, MemoryOptions, ModelShape, PlanInputs, Strategy, get_gpu, memory_per_gpu, plan
from stalwart.plan.compute import flops_per_token
from stalwart.plan.step_time import step_time
from stalwart.train.lamb import Lamb

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden=64, max_seq_len=16)


def _init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.ndim > 1 else 1.0))
    return model


# -- sliding-window attention ------------------------------------------------------------------------
def dense_attention(attn: Attention, x: torch.Tensor, rope: torch.Tensor, window: int) -> torch.Tensor:
    """softmax(QKᵀ/√d + mask)·V with the mask written out: query i sees keys j with i - window < j ≤ i."""
    b, s, _ = x.shape
    hd, rep = attn.args.head_dim, attn.args.n_heads // attn.args.kv_heads
    q = apply_rope(attn.wq(x).view(b, s, -1, hd), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, s, -1, hd), rope).transpose(1, 2).repeat_interleave(rep, 1)
    v = attn.wv(x).view(b, s, -1, hd).transpose(1, 2).repeat_interleave(rep, 1)
    allowed = torch.tensor([[i - window < j <= i for j in range(s)] for i in range(s)])
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("window", [1, 3, 8, 16, 40])
def test_window_attention_matches_an_explicit_mask(window):
    attn = _init(Attention(ARGS.with_(attn_window=window)))
    x = torch.randn(2, 16, ARGS.dim, generator=torch.Generator().manual_seed(1))
    rope = rope_tables(ARGS.head_dim, 16, ARGS.rope_theta)
    torch.testing.assert_close(attn(x, rope), dense_attention(attn, x, rope, window), atol=1e-5, rtol=1e-5)


def test_window_changes_the_output_only_where_the_window_cuts():
    full, win = _init(Attention(ARGS)), _init(Attention(ARGS.with_(attn_window=4)))
    x = torch.randn(1, 16, ARGS.dim)
    rope = rope_tables(ARGS.head_dim, 16, ARGS.rope_theta)
    a, b = full(x, rope), win(x, rope)
    torch.testing.assert_close(a[:, :4], b[:, :4])  # the first 4 tokens see everything either way
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3


def test_window_attention_with_alibi_masks_the_bias():
    args = ARGS.with_(pos="alibi", attn_window=3)
    attn = _init(Attention(args))
    x = torch.randn(1, 8, args.dim)
    out = attn(x, None)
    x2 = x.clone()
    x2[:, 0] += 10.0  # token 0 is out of the window of tokens ≥ 3
    torch.testing.assert_close(attn(x2, None)[:, 3:], out[:, 3:])


# -- parallel block and embedding norm --------------------------------------------------------------
def test_parallel_block_is_x_plus_attn_plus_mlp_of_one_norm():
    block = _init(Block(ARGS.with_(parallel_block=True)))
    assert block.ffn_norm is None
    x = torch.randn(2, 8, ARGS.dim)
    rope = rope_tables(ARGS.head_dim, 8, ARGS.rope_theta)
    h = block.attention_norm(x)
    torch.testing.assert_close(block(x, rope), x + block.attention(h, rope) + block.feed_forward(h))


def test_embed_norm_is_a_layernorm_after_the_embedding_and_in_the_state_dict():
    model = Transformer(ARGS.with_(embed_norm=True))
    model.init_weights(0)
    sd = model.state_dict()
    assert torch.equal(sd["embed_norm.weight"], torch.ones(ARGS.dim)) and torch.equal(
        sd["embed_norm.bias"], torch.zeros(ARGS.dim)
    )
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    seen = {}
    model.layers["0"].register_forward_pre_hook(lambda _m, inp: seen.update(h=inp[0]))
    model(tokens)
    torch.testing.assert_close(seen["h"], F.layer_norm(model.tok_embeddings(tokens), (ARGS.dim,)))


@pytest.mark.parametrize("opts", [{}, {"parallel_block": True}, {"embed_norm": True}, {"attn_window": 8}])
def test_planner_parameter_count_matches_the_model(opts):
    args = model_args("debug").with_(**opts)
    assert ModelShape.from_args(args).total_params() == meta_param_count(args)


# -- LAMB against the paper ------------------------------------------------------------------------
def lamb_reference(params, grads_per_step, lr, betas, eps, wd):
    """You et al. 2019, Algorithm 2, one tensor at a time in float64."""
    b1, b2 = betas
    x = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in x]
    v = [torch.zeros_like(p) for p in x]
    history = []
    for t, grads in enumerate(grads_per_step, 1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            r = (m[i] / (1 - b1**t)) / (torch.sqrt(v[i] / (1 - b2**t)) + eps)
            u = r + wd[i] * x[i]
            wn, un = x[i].norm(), u.norm()
            trust = wn / un if wn > 0 and un > 0 else 1.0
            x[i] = x[i] - lr * trust * u
        history.append([p.clone() for p in x])
    return history


def test_lamb_follows_the_paper_step_by_step():
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((8, 4), (4,), (3, 5, 2))]
    params.append(torch.nn.Parameter(torch.zeros(6)))  # zero norm: trust ratio 1
    wd = [0.1, 0.0, 0.1, 0.0]
    steps = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(8)]
    ref = lamb_reference([p.detach() for p in params], steps, 0.01, (0.9, 0.95), 1e-8, wd)
    opt = Lamb(
        [
            {"params": [params[0], params[2]], "weight_decay": 0.1},
            {"params": [params[1], params[3]], "weight_decay": 0.0},
        ],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for grads, expected in zip(steps, ref):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, e in zip(params, expected):  # stated tolerance: fp32 vs the fp64 reference
            torch.testing.assert_close(p.detach().double(), e, atol=1e-6, rtol=1e-5)


def test_lamb_is_chosen_by_config_and_adamw_stays_the_default():
    from stalwart.train.optim import build_optimizer

    model = Transformer(ARGS)
    assert load_config().optim.name == "adamw"
    cfg = load_config(overrides={"optim.name": "lamb"})
    assert isinstance(build_optimizer(model, cfg.train, cfg.optim.name), Lamb)
    assert isinstance(build_optimizer(model, cfg.train), torch.optim.AdamW)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"optim.name": "sgd"}, "optim.name"),
        ({"model.attn_window": "-1"}, "attn_window"),
    ],
)
def test_config_mistakes_are_explained(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides=overrides).validate()


def test_cpu_offload_needs_fsdp2_shards():
    from stalwart.train.resolve import resolve

    ddp = load_config(overrides={"parallel.cpu_offload": "true"})  # dp_mode = "ddp": replicas, no shards
    cfg = load_config(overrides={"parallel.cpu_offload": "true", "parallel.dp_mode": "fsdp"})
    for config, world in ((ddp, 2), (cfg, 1)):
        with pytest.raises(ValueError, match="no FSDP2 shards to offload; set parallel.dp_mode='fsdp'"):
            resolve(config, world)
    assert resolve(cfg, 2).options.cpu_offload


# -- the planner ---------------------------------------------------------------------------------------
CLUSTER = Cluster(get_gpu("h100"), 64)
SHAPE = ModelShape.from_args(model_args("llama2-7b"), name="llama2-7b")


def _step(shape: ModelShape, strategy: Strategy, batch: int = 64):
    return step_time(shape, strategy, CLUSTER, 4096, batch, 1e9)


@pytest.mark.parametrize("recompute, ratio", [("none", 0.5), ("selective", 0.5), ("full", 0.5)])
def test_parallel_block_halves_tp_communication(recompute, ratio):
    strategy = Strategy.of(dp=8, tp=8, recompute=recompute)
    serial = _step(SHAPE, strategy)
    parallel = _step(ModelShape.from_args(model_args("llama2-7b", parallel_block=True)), strategy)
    assert serial.tp_comm > 0
    assert parallel.tp_comm == pytest.approx(ratio * serial.tp_comm)


def test_window_attention_flops_use_the_window():
    full = flops_per_token(1e9, 32, 4096, 4096)
    assert flops_per_token(1e9, 32, 4096, 4096, window=1024) == pytest.approx(full - 12 * 32 * 4096 * 3072)
    assert flops_per_token(1e9, 32, 4096, 4096, window=8192) == full  # min(W, s)
    windowed = ModelShape.from_args(model_args("llama2-7b", attn_window=512))
    strategy = Strategy.of(dp=64)
    assert _step(windowed, strategy).compute < _step(SHAPE, strategy).compute


def test_cpu_offload_moves_the_sharded_state_off_the_device():
    for zero in (1, 3):
        strategy = Strategy.of(dp=64, zero=zero)
        on = memory_per_gpu(SHAPE, strategy, 4096, 64)
        off = memory_per_gpu(SHAPE, strategy, 4096, 64, MemoryOptions(cpu_offload=True))
        assert on.optimizer > 0 and off.optimizer == 0
        moved = on.optimizer + (on.weights + on.grads if zero == 3 else 0.0)
        assert off.offloaded == pytest.approx(moved)
        assert off.total == pytest.approx(on.total - moved)


def test_plan_reports_the_bubble_at_1x_and_4x_batch():
    out = plan(PlanInputs(model="llama2-7b", gpu="h100", gpus=64, tokens=1e12, pp=4, global_batch=256))
    bubble = out["pipeline_bubble"]
    assert bubble["layout"]["pp"] == 4 and bubble["global_batch_4x"] == 1024
    assert 0 < bubble["bubble_share_4x"] < bubble["bubble_share"]
    # Bubble time is fixed per step, so at 4x the micro-batches its share falls by about 3/4.
    assert 0.6 < bubble["bubble_share_cut"] < 0.75
