"""Pure logic of stalwart.train.parallel: layout validation, config parsing, stage splitting, auto
layout from the planner, option checks."""

from __future__ import annotations

import itertools

import pytest

from stalwart.models import model_args, moe_args
from stalwart.plan.auto import auto_layout
from stalwart.plan.parallel import CP_UNSUPPORTED, Layout, layout_from_config
from stalwart.train.parallel import ParallelOptions, split_layers, stage_layers
from stalwart.train.parallel.pipeline import stage_ids

DEBUG = model_args("debug", vocab_size=257, max_seq_len=32)  # 4 layers, 4 heads, 2 kv heads


# -- Layout ---------------------------------------------------------------------------------------
def test_layout_sizes_and_description():
    lo = Layout(dp_replicate=2, dp_shard=4, tp=2, pp=3, ep=2)
    assert lo.world_size == 2 * 4 * 2 * 3 and lo.dp == 8
    assert lo.shape == (3, 2, 2, 2, 1, 2)  # pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp
    assert lo.describe() == "dp_replicate=2 × dp_shard=4 × tp=2 × pp=3 × ep=2"
    assert Layout().describe() == "single rank"
    assert Layout(dp_replicate=4).uses_ddp and not Layout(dp_replicate=2, tp=2).uses_ddp


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dp_shard=2, ep=4), "must divide parallel.dp_shard"),
        (dict(ep=2), "must divide parallel.dp_shard=1"),
        (dict(tp=0), "positive integer"),
    ],
)
def test_layout_rejects_with_actionable_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)
    assert "CPU" in CP_UNSUPPORTED and "cp = 1" in CP_UNSUPPORTED


def test_context_parallel_is_planned_but_not_built():
    assert Layout(cp=2).world_size == 2  # the planner models cp; the trainer refuses to build it
    with pytest.raises(ValueError, match="context parallel"):
        Layout(cp=2).check_model(DEBUG)
    with pytest.raises(ValueError, match="context parallel"):
        layout_from_config({"cp": 2}, 2)


def test_world_mismatch_names_both_numbers():
    with pytest.raises(ValueError, match=r"needs .* = 4 ranks but the job has 2"):
        Layout(dp_shard=2, tp=2).check_world(2)


@pytest.mark.parametrize(
    "layout,kw,message",
    [
        (Layout(tp=4), {}, r"tp=4 must divide model.n_heads=4 and model.n_kv_heads=2.*use tp in \[1, 2\]"),
        (Layout(pp=4), dict(virtual_stages=2), "8 pipeline stages but the model has only 4 layers"),
        (Layout(dp_shard=2, ep=2), {}, "needs a mixture-of-experts model"),
    ],
)
def test_model_checks(layout, kw, message):
    with pytest.raises(ValueError, match=message):
        layout.check_model(DEBUG, None, **kw)


def test_moe_model_checks():
    moe = moe_args("debug-moe")
    Layout(dp_shard=4, ep=4).check_model(DEBUG, moe)
    with pytest.raises(ValueError, match="must divide the expert count 4"):
        Layout(dp_shard=3, ep=3).check_model(DEBUG, moe)
    with pytest.raises(ValueError, match="tensor parallelism of MoE blocks is not implemented"):
        Layout(tp=2).check_model(DEBUG, moe)


def test_mesh_owns_its_flattened_axes():
    """build_mesh returns a Mesh that holds the flattened axes itself (no module-level cache)."""
    import torch.distributed as dist

    from stalwart.train.parallel import Mesh, build_mesh, coords

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh(Layout())
        assert isinstance(mesh, Mesh) and set(mesh.flat) == {"dp", "dp_shard", "dp_replicate,dp_shard"}
        assert mesh["dp"] is mesh.flat["dp"] and mesh["dp_replicate", "dp_shard"].mesh_dim_names == (
            "dp_replicate",
            "dp_shard",
        )
        assert mesh["tp"].mesh_dim_names == ("tp",) and coords(mesh).dp_size == 1
        assert build_mesh(Layout()).flat["dp"] is not None  # a second mesh gets its own
    finally:
        if owned:
            dist.destroy_process_group()


# -- config → layout ------------------------------------------------------------------------------
def test_layout_from_config():
    assert layout_from_config({"dp": 2, "tp": 2}, 4) == Layout(dp_shard=2, tp=2)
    assert layout_from_config({"dp": 2}, 2, dp_mode="ddp") == Layout(dp_replicate=2)
    assert layout_from_config({"tp": 2}, 8) == Layout(dp_shard=4, tp=2)  # dp fills the rest
    assert layout_from_config({"pp": 2, "ep": 2}, 4) == Layout(dp_shard=2, pp=2, ep=2)
    assert layout_from_config({"dp_replicate": 2, "tp": 2}, 8) == Layout(dp_replicate=2, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match="unknown parallel keys"):
        layout_from_config({"dpp": 2}, 2)
    with pytest.raises(ValueError, match="not both"):
        layout_from_config({"dp": 2, "dp_shard": 2}, 4)
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        layout_from_config({"tp": 4}, 6)
    with pytest.raises(ValueError, match="auto_layout"):
        layout_from_config("auto", 2)  # type: ignore[arg-type]


# -- stage splitting --------------------------------------------------------------------------------
def test_even_split():
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert split_layers(10, 4) == [3, 3, 2, 2]
    assert split_layers(4, 4) == [1, 1, 1, 1]


def _best_worst(n_layers: int, n_stages: int, w: float) -> float:
    best = float("inf")
    for counts in itertools.product(range(1, n_layers + 1), repeat=n_stages):
        if sum(counts) == n_layers:
            costs = [c + (w if i in (0, n_stages - 1) else 0) for i, c in enumerate(counts)]
            best = min(best, max(costs))
    return best


@pytest.mark.parametrize("n_layers,n_stages", [(4, 2), (8, 4), (9, 3), (12, 4), (7, 3), (6, 5)])
def test_lighter_ends_is_optimal_and_lighter(n_layers, n_stages):
    counts = split_layers(n_layers, n_stages, "lighter_ends", end_weight=1.0)
    assert sum(counts) == n_layers and min(counts) >= 1 and len(counts) == n_stages
    costs = [c + (1.0 if i in (0, n_stages - 1) else 0) for i, c in enumerate(counts)]
    assert max(costs) == _best_worst(n_layers, n_stages, 1.0)  # minimises the slowest stage
    if n_stages > 2:
        assert counts[0] <= min(counts[1:-1]) and counts[-1] <= min(counts[1:-1])


def test_glm_style_split_of_a_large_model():
    # 70 layers over 8 stages: ends carry embedding/head, so they get fewer blocks
    counts = split_layers(70, 8, "lighter_ends")
    assert sum(counts) == 70 and counts[0] < max(counts) and counts[-1] < max(counts)


def test_explicit_split_and_errors():
    assert split_layers(8, 3, [2, 4, 2]) == [2, 4, 2]
    with pytest.raises(ValueError, match="sum to 8"):
        split_layers(8, 3, [2, 2, 2])
    with pytest.raises(ValueError, match="only 4 layers"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="must be 'even'"):
        split_layers(4, 2, "heavy")


def test_interleaved_stage_placement():
    assert stage_ids(0, 2, 2) == [0, 2] and stage_ids(1, 2, 2) == [1, 3]
    layers = stage_layers(8, 2, 2)
    assert layers == [[0, 1], [2, 3], [4, 5], [6, 7]]
    rank0 = [i for s in stage_ids(0, 2, 2) for i in layers[s]]
    assert rank0 == [0, 1, 4, 5]


# -- options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout,opts,message",
    [
        (Layout(pp=2), ParallelOptions(virtual_stages=2), "needs schedule='interleaved_1f1b'"),
        (Layout(pp=2), ParallelOptions(schedule="interleaved_1f1b"), "virtual_stages ≥ 2"),
        (Layout(pp=2), ParallelOptions(schedule="zb"), "not one of"),
        (Layout(dp_shard=2), ParallelOptions(compress="powersgd"), "needs plain DDP"),
        (Layout(), ParallelOptions(compress="bf16"), "dp = 1"),
        (Layout(dp_replicate=2), ParallelOptions(compress="int8"), "not one of"),
        (Layout(), ParallelOptions(recompute="some"), "not one of"),
    ],
)
def test_option_checks(layout, opts, message):
    with pytest.raises(ValueError, match=message):
        opts.check(layout)


# -- auto layout ----------------------------------------------------------------------------------
def _world(lo: Layout) -> int:
    return lo.pp * lo.dp_replicate * lo.dp_shard * lo.cp * lo.tp


def test_auto_layout_fits_and_explains():
    choice = auto_layout(DEBUG, 4, 32, 8, micro_batch=2)
    assert _world(choice.layout) == 4 and choice.micro_batch == 2
    choice.layout.check_model(DEBUG)
    assert choice.why.startswith("parallel = 'auto' chose") and "ms/step" in choice.why
    assert choice.candidates and choice.candidates[0]["step_time_s"] > 0


def test_auto_layout_respects_memory():
    roomy = auto_layout(DEBUG, 4, 32, 8, micro_batch=2, memory_gb=100)
    tight = auto_layout(DEBUG, 4, 32, 8, micro_batch=2, memory_gb=0.012)
    assert tight.candidates[0]["memory_gb"] <= 0.012 * 0.9
    assert tight.candidates[0]["memory_gb"] <= roomy.candidates[0]["memory_gb"]
    with pytest.raises(ValueError, match="found no layout"):
        auto_layout(DEBUG, 4, 32, 8, micro_batch=2, memory_gb=0.001)


def test_auto_layout_only_builds_what_is_supported():
    big = model_args("llama3-8b")
    choice = auto_layout(big, 64, 8192, 512, gpu="h100")
    choice.layout.check_model(big)
    assert _world(choice.layout) == 64 and choice.layout.cp == 1
    moe = moe_args("debug-moe")
    for cand in auto_layout(DEBUG, 4, 32, 8, moe=moe, micro_batch=2, top=10).candidates:
        assert cand["tp"] == 1  # TP of MoE blocks is not implemented, so never proposed
