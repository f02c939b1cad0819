"""Layout search: published layouts are feasible and rank in the top 10 for their setting; the
pipeline bubble follows Narayanan et al. 2021; rejected layouts carry a reason."""

import pytest

from stalwart.plan.compute import flops_per_token
from stalwart.plan.hardware import Cluster, custom_gpu, get_gpu
from stalwart.plan.layout import StepModel, search, step_time
from stalwart.plan.memory import ActivationOptions, MemoryOptions, Precision, memory_per_gpu
from stalwart.plan.parallel import Strategy, partition_layers
from stalwart.plan.shape import ModelShape, shape_for


def run_search(model, gpu, n_gpus, batch, zero, network_gbps, mem=MemoryOptions(), **kw):
    shape = shape_for(model)
    cluster = Cluster(custom_gpu(get_gpu(gpu), inter_node_gbps=network_gbps), n_gpus)
    fpt = flops_per_token(shape.total_params(), attention=False)
    return shape, cluster, search(shape, cluster, 2048, batch, fpt, zero=zero, mem=mem, **kw)


# BLOOM-176B (BigScience 2022): 48 nodes × 8 A100-80GB, 4 × 100 Gb/s Omni-Path per node (6.25 GB/s
# per GPU), global batch 2048 × 2048 tokens, ZeRO-1, bf16 with fp32 gradient accumulation, no SP.
BLOOM_MEM = MemoryOptions(Precision(grad_bytes=4.0), ActivationOptions(sequence_parallel=False, flash_attention=False))


def test_bloom_published_layout_ranks_top10():
    shape, cluster, found = run_search("bloom-176b", "a100-80g", 384, 2048, 1, 6.25, BLOOM_MEM)
    rank = found.rank_of(dp=8, tp=4, pp=12)
    assert rank is not None and rank <= 10, [c.layout for c in found.layouts[:10]]
    # the exact published variant (micro-batch 2, full recompute) fits in 80 GB
    exact = Strategy.of(8, 4, 12, micro_batch=2, zero=1, recompute="full")
    assert memory_per_gpu(shape, exact, 2048, 2048, BLOOM_MEM).total <= cluster.gpu.memory_bytes * 0.9


def test_falcon_published_layout_ranks_top10():
    # Falcon-180B: 4096 A100-40GB on AWS p4d (400 Gb/s EFA per node), 64DP×8PP×8TP, ZeRO-1, batch 2048
    _, _, found = run_search("falcon-180b", "a100-40g", 4096, 2048, 1, 6.25)
    rank = found.rank_of(dp=64, tp=8, pp=8)
    assert rank is not None and rank <= 10, [c.layout for c in found.layouts[:10]]


def test_opt_published_layout_ranks_top10():
    # OPT-175B: 992 A100-80GB, Megatron TP=8 + FSDP (ZeRO-3) over 124 replicas, ~2M tokens per step
    # (992 sequences × 2048), 8 × 200 Gb/s HDR per node; no SP or flash attention in 2021.
    mem = MemoryOptions(activations=ActivationOptions(sequence_parallel=False, flash_attention=False))
    _, _, found = run_search("opt-175b", "a100-80g", 992, 992, 3, 25, mem)
    rank = found.rank_of(dp=124, tp=8, pp=1)
    assert rank is not None and rank <= 10


def test_rejections_carry_reasons():
    _, _, found = run_search("gpt3-175b", "a100-40g", 64, 512, 1, 25, recompute="none")
    assert found.rejected["tp larger than a node"] > 0
    assert found.rejected["out of memory"] > 0
    assert "GB usable" in found.examples["out of memory"]
    for cand in found.layouts:
        assert cand.layout.tp <= 8 and cand.memory.total <= 0.9 * 40 * 2**30
    _, _, z3 = run_search("gpt3-175b", "a100-80g", 64, 512, 3, 25)
    assert all(c.layout.pp == 1 for c in z3.layouts)
    assert z3.rejected["ZeRO-2/3 with pipeline parallelism"] > 0


def test_pins_are_respected():
    _, _, found = run_search("llama2-7b", "h100", 64, 256, 1, 50, fixed={"tp": 2, "micro_batch": 1})
    assert found.layouts and all(c.layout.tp == 2 and c.strategy.micro_batch == 1 for c in found.layouts)


@pytest.mark.parametrize("pp,v,m", [(4, 1, 8), (8, 1, 32), (4, 2, 16)])
def test_pipeline_bubble_fraction(pp, v, m):
    # Narayanan et al. 2021: bubble / ideal time = (p - 1) / (v·m) when communication is free
    shape = ModelShape("even", dim=1024, n_layers=16, n_heads=8, kv_heads=8, ffn_hidden=4096, vocab_size=1000)
    fast = custom_gpu(get_gpu("h100"), intra_node_gbps=1e12, inter_node_gbps=1e12)
    lay = Strategy.of(dp=1, pp=pp, micro_batch=1, virtual_stages=v, zero=1)
    st = step_time(shape, lay, Cluster(fast, pp), 1024, m, 6e9, model=StepModel())
    assert st.bubble / st.compute == pytest.approx((pp - 1) / (v * m), rel=1e-6)


def test_partition_balances_the_head():
    assert partition_layers(8, 2) == [4, 4]
    assert partition_layers(8, 2, head_share=2.0) == [5, 3]  # 5 vs 3 + 2
    assert sum(partition_layers(70, 12, 1.46)) == 70
