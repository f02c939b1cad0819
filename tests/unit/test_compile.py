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
