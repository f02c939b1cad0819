"""Overlap options (docs/techniques.md, "Overlap"): which FSDP2 blocks prefetch which, the clear errors
for async TP where it cannot run, and the planner's exposed communication with and without overlap."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stalwart.cli import main
from stalwart.config import load_config
from stalwart.train.parallel.overlap import check_async_tp, set_fsdp_prefetch


@pytest.fixture(scope="module")
def world_of_one():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))


def _states(block, kind):  # torch keeps the modules it was given as their FSDP states
    return getattr(block._get_fsdp_state(), f"_states_to_{kind}_prefetch")


@pytest.mark.parametrize("depth", [1, 2])
def test_each_block_prefetches_the_next_in_forward_and_the_previous_in_backward(world_of_one, depth):
    blocks = [torch.nn.Linear(4, 4) for _ in range(4)]
    for b in blocks:
        fully_shard(b, mesh=world_of_one)
    set_fsdp_prefetch(blocks, depth)
    state = [b._get_fsdp_state() for b in blocks]
    for i, b in enumerate(blocks):
        assert _states(b, "forward") == state[i + 1 : i + 1 + depth]
        assert _states(b, "backward") == state[max(0, i - depth) : i][::-1]


def test_depth_zero_leaves_fsdp2s_implicit_prefetch(world_of_one):
    blocks = [torch.nn.Linear(4, 4) for _ in range(3)]
    for b in blocks:
        fully_shard(b, mesh=world_of_one)
    set_fsdp_prefetch(blocks, 0)
    assert all(not _states(b, "forward") and not _states(b, "backward") for b in blocks)
    with pytest.raises(ValueError, match="fsdp_prefetch must be ≥ 0"):
        set_fsdp_prefetch(blocks, -1)


def test_async_tp_is_a_clear_error_where_it_cannot_run():
    check_async_tp(False, 1, torch.device("cpu"))  # off: nothing to check
    with pytest.raises(ValueError, match="tp = 1"):
        check_async_tp(True, 1)
    with pytest.raises(ValueError, match="needs CUDA"):
        check_async_tp(True, 2, torch.device("cpu"))


def test_config_checks_the_overlap_keys():
    for key, bad in (("parallel.fsdp_prefetch", -1), ("parallel.ddp_bucket_mb", 0)):
        with pytest.raises(ValueError, match=key):
            load_config(overrides={key: bad}).validate()
    from stalwart.train.resolve import resolve

    with pytest.raises(ValueError, match="train.compile"):
        resolve(load_config(overrides={"parallel.tp": 2, "parallel.async_tp": True}), 2)
    fsdp = load_config(overrides={"parallel.dp_mode": "fsdp", "parallel.tp": 2, "parallel.fsdp_prefetch": 2})
    assert resolve(fsdp, 4).summary()["overlap"] == {"fsdp_prefetch": 2, "async_tp": False}
    ddp = resolve(load_config(overrides={"parallel.ddp_bucket_mb": 4}), 2)
    assert ddp.options.ddp_bucket_mb == 4.0 and ddp.summary()["overlap"] == {"ddp_bucket_mb": 4.0}
    pp_tp = resolve(load_config(overrides={"parallel.pp": 2, "parallel.tp": 2, "parallel.pp_scatter_gather": False}), 4)
    assert pp_tp.summary()["overlap"] == {"async_tp": False, "pp_scatter_gather": False}


def test_planner_shows_exposed_communication_with_and_without_overlap(capsys):
    argv = ["plan", "--model", "llama2-7b", "--gpu", "a100-80g", "--gpus", "64", "--tokens", "1T"]
    argv += ["--dp", "64", "--tp", "1", "--pp", "1", "--json"]
    runs = {}
    for extra in ([], ["--no-overlap"]):
        assert main(argv + extra) == 0
        runs[bool(extra)] = json.loads(capsys.readouterr().out)["layouts"][0]
    on, off = runs[False], runs[True]
    assert on["step_breakdown_s"]["compute"] == off["step_breakdown_s"]["compute"]
    assert off["step_time_s"] > on["step_time_s"]
    assert off["exposed_comm_fraction"] > on["exposed_comm_fraction"] >= 0
