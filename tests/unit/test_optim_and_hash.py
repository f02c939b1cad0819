import math

import pytest
import torch

from stalwart.config import TrainConfig
from stalwart.plan.compute import flops_per_token
from stalwart.train.optim import build_optimizer, build_scheduler, lr_at
from stalwart.utils import state_dict_hash


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)


def test_scheduler_follows_lr_at_and_decay_skips_vectors():
    cfg = TrainConfig(steps=20, warmup_steps=5, lr=0.5, min_lr=0.05, weight_decay=0.3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, cfg)
    decays = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert decays == [(0.0, 3), (0.3, 1)]  # biases and norm weights are not decayed
    sched = build_scheduler(opt, cfg)
    for step in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, cfg))
        opt.step()
        sched.step()


def test_state_dict_hash_is_bitwise():
    a = {"w": torch.arange(6.0).reshape(2, 3), "opt": {"step": 3, "m": [torch.zeros(2)]}}
    b = {"opt": {"m": [torch.zeros(2)], "step": 3}, "w": torch.arange(6.0).reshape(2, 3)}
    assert state_dict_hash(a) == state_dict_hash(b)
    c = {**a, "w": a["w"].clone()}
    c["w"][0, 0] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    assert state_dict_hash(a) != state_dict_hash(c)
    assert state_dict_hash(a) != state_dict_hash({**a, "w": a["w"].reshape(3, 2)})
    assert state_dict_hash(a) != state_dict_hash({**a, "w": a["w"].double()})
    assert state_dict_hash(a) != state_dict_hash({**a, "opt": {"step": 4, "m": [torch.zeros(2)]}})
    assert state_dict_hash({"s": torch.tensor(1.5)}) != state_dict_hash({"s": torch.tensor(2.5)})


def test_flops_per_token():
    assert flops_per_token(1e9) == 6e9
    assert flops_per_token(1e9, recompute=True) == 8e9
    assert flops_per_token(1e9, n_layers=2, dim=10, seq_len=100) == 6e9 + 12 * 2 * 10 * 100
    with pytest.raises(ValueError):
        flops_per_token(-1)
    assert math.isfinite(flops_per_token(175e9))
