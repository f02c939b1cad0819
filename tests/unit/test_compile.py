"""``train.compile``: the compiled step follows the eager one (losses within 1e-5), really is compiled
(its arithmetic differs in the last bits), and a compiled run restored from a mid-run state continues
bitwise as the uninterrupted compiled run. Slow by nature (inductor generates and compiles C++);
the shapes are the smallest the debug model takes. Needs a C++ compiler: skipped, saying so, without.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile (inductor) on the CPU needs a C++ compiler (g++/c++) and none is on PATH",
)


@pytest.fixture
def make(stdlib_data: Path, tmp_path: Path):
    from stalwart.config import load_config
    from stalwart.dist import init_distributed, shutdown
    from stalwart.train.trainer import Trainer

    env = init_distributed("gloo")

    def build(compile: bool, name: str) -> Trainer:
        cfg = load_config(
            "configs/debug.toml",
            {
                "data.dir": str(stdlib_data),
                "data.prepare_default": False,
                "data.seq_len": 32,
                "train.global_batch": 4,
                "train.micro_batch": 2,
                "train.steps": 4,
                "train.warmup_steps": 0,
                "train.threads": 1,
                "train.tensorboard": "off",
                "train.compile": compile,
                "train.out_dir": str(tmp_path / name),
            },
        )
        return Trainer(cfg, env)

    yield build
    shutdown()


def run(trainer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        stats = trainer.train_step()
        stats.settle()
        losses.append(float(stats.loss))
    return losses


def test_compiled_blocks_follow_eager_and_resume_bitwise(make):
    eager = make(False, "eager")
    want = run(eager, 4)
    full = make(True, "compiled")
    assert full.compiled_blocks == full.model_args.n_layers
    got = run(full, 2)
    saved = {k: copy.deepcopy(v.state_dict()) for k, v in full.state.items()}  # what a checkpoint holds
    got += run(full, 2)  # the uninterrupted compiled run goes on
    assert got == pytest.approx(want, abs=1e-5, rel=0), "compiled losses within 1e-5 of eager"
    assert full.weights_hash() != eager.weights_hash(), "the compiled run did not run compiled code"

    resumed = make(True, "resumed")  # a fresh compiled trainer restored from the state after step 2
    for key, value in saved.items():
        resumed.state[key].load_state_dict(value)
    resumed.step = 2
    assert run(resumed, 2) == got[2:], "resumed losses bitwise those of the uninterrupted run"
    assert resumed.weights_hash() == full.weights_hash()
    assert resumed.optimizer_hash() == full.optimizer_hash()


@pytest.mark.parametrize("pos,window", [("rope", 0), ("rope", 8), ("alibi", 0), ("alibi", 8)])
def test_the_attention_record_asks_torch_with_the_mask_the_model_passes(monkeypatch, pos, window):
    """summary.json's SDPA backend is torch's choice for the model's own call: a sliding window or ALiBi
    is an explicit mask (on CUDA no flash kernel), plain causal attention is ``is_causal``."""
    import dataclasses

    import torch

    from stalwart.models import model_args
    from stalwart.models.llama import attention_mask
    from stalwart.train import compile as compile_mod

    asked: dict = {}
    monkeypatch.setattr(compile_mod, "sdpa_backend", lambda q, k, v, **kw: asked.update(kw) or "recorded")
    args = dataclasses.replace(model_args("debug"), pos=pos, attn_window=window)
    out = compile_mod.attention_backend(args, 2, 32, 1, torch.float32, torch.device("cpu"))
    assert out["backend"] == "recorded"
    expected = attention_mask(args, 32, torch.device("cpu"), torch.float32)
    if expected is None:
        assert asked["attn_mask"] is None and asked["is_causal"]
    else:
        assert torch.equal(asked["attn_mask"], expected) and not asked["is_causal"]
