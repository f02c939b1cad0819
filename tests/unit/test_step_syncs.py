"""The training step reads no device value on the host and issues only the collectives it needs.

A real Trainer in one process (a world of one over an in-memory store, as `stalwart train` without a
launcher). Every host read of a tensor (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``)
made from stalwart's code is counted, except reads of host copies staged by
``stalwart.train.metrics.HostCopy`` (on CUDA those are read only once their asynchronous copy has
finished, which ``Event.query`` tells without waiting). torch's own host-side scalars (AdamW keeps its
step counters on the CPU by design) are not syncs and are not counted: only stalwart's frames are.
Collectives are counted wherever they come from.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stalwart
from stalwart.train.hooks import GuardHook, StepStats
from stalwart.train.metrics import HOST_COPY_MARK, HostCopy, MetricsHook

STALWART_DIR = str(Path(stalwart.__file__).parent)
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor", "barrier")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts host reads from stalwart code, collectives, and device synchronisations."""
    counts: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(STALWART_DIR) and not getattr(self, HOST_COPY_MARK, False):
                counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def collective(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, collective)

    def synchronize(*args, **kwargs):
        counts["cuda.synchronize"] += 1

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return counts


@pytest.fixture
def trainer(stdlib_data: Path, tmp_path: Path):
    from stalwart.config import load_config
    from stalwart.dist import init_distributed, shutdown
    from stalwart.train.trainer import Trainer

    cfg = load_config(
        "configs/debug.toml",
        {
            "data.dir": str(stdlib_data),
            "data.prepare_default": False,
            "data.seq_len": 32,
            "train.global_batch": 4,
            "train.micro_batch": 2,
            "train.steps": 20,
            "train.log_every": 10,
            "train.warmup_steps": 0,
            "train.threads": 1,
            "train.out_dir": str(tmp_path),
        },
    )
    env = init_distributed("gloo")
    try:
        t = Trainer(cfg, env)
        t.metrics.open(t.step, progress=False)
        yield t
        t.metrics.close()
    finally:
        shutdown()


def test_a_non_log_step_reads_nothing_on_the_host_and_issues_no_collective(trainer, counted: Counter):
    trainer.train_step()  # step 1: lazy initialisation (optimizer state) is not the steady state
    counted.clear()
    stats = trainer.train_step()  # step 2: not a log step, guard off
    assert trainer.step == 2 and isinstance(stats, StepStats)
    assert trainer.pm.micro_batches(4) == 2, "two micro-batches: accumulation is on the path"
    assert counted == Counter(), f"host syncs or collectives on the step path: {dict(counted)}"
    # The record of step 2 is still written (on the CPU its host copy is the value itself).
    lines = (Path(trainer.cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert trainer.metrics.last_loss == pytest.approx(float(stats.loss))


def test_a_steady_step_walks_no_module_tree(trainer, monkeypatch: pytest.MonkeyPatch):
    """Walking the modules (``parameters()``, ``named_modules()``) is Python work that grows with the
    model, on every step; clipping did it until issue 28's profile."""
    trainer.train_step()  # step 1 may take what it keeps (the parameter list)
    walks: Counter = Counter()
    original = torch.nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        walks[sys._getframe(1).f_code.co_name] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "named_modules", named_modules)
    assert isinstance(trainer.train_step(), StepStats)
    assert walks == Counter(), f"module walks on the step path, by caller: {dict(walks)}"


def test_the_guard_reads_loss_and_norm_once_per_step(counted: Counter):
    """With the guard on every step syncs (it judges before the update): one all-reduce, one read."""
    from stalwart.dist import init_distributed, shutdown

    class Guard:
        def judge(self, step, loss, grad_norm):
            self.seen = (step, loss, grad_norm)

    guard = Guard()
    init_distributed("gloo")
    try:
        stats = StepStats(7, torch.tensor(2.5), torch.tensor(0.75), torch.tensor(0.0), 1e-3)
        assert GuardHook(guard, world_size=1).after_backward(None, stats) is None
    finally:
        shutdown()
    assert guard.seen == (7, 2.5, 0.75)
    assert counted == Counter(all_reduce=1, tolist=1)


class _SlowCopy(HostCopy):
    """A host copy whose device-to-host transfer has not finished (as on a busy GPU)."""

    done = False

    def ready(self) -> bool:
        return self.done


def test_records_wait_for_their_host_copy_except_at_log_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from stalwart.train import metrics

    monkeypatch.setattr(metrics, "HostCopy", _SlowCopy)
    monkeypatch.setattr(_SlowCopy, "done", False)
    reported = []
    monkeypatch.setattr(stalwart, "report", lambda step, **kw: reported.append((step, kw["loss"])))

    class FakeTrainer:
        class sampler:
            consumed = 0

        class timer:
            @staticmethod
            def resolved():
                return []

    hook = MetricsHook(
        tmp_path,
        total_steps=4,
        log_every=2,
        tokens_per_step=8,
        world_size=1,
        flops_per_token=1.0,
        peak_flops=None,
        main=True,
    )
    hook.open(0, progress=False)
    path = tmp_path / "metrics.jsonl"

    def step(s: int) -> None:
        hook.after_step(FakeTrainer, StepStats(s, torch.tensor(float(s)), torch.tensor(1.0), torch.tensor(0.0), 0.1))

    step(1)
    assert path.read_text() == "" and reported == [(1, None)], "a copy in flight is not waited for"
    step(2)  # a log step: everything pending is read (the one place a sync is allowed)
    assert [line.count('"step"') for line in path.read_text().splitlines()] == [1, 1]
    assert hook.last_loss == 2.0 and reported[-1] == (2, 2.0)
    _SlowCopy.done = True
    step(3)
    hook.close()
    assert len(path.read_text().splitlines()) == 3, "a finished copy is written without waiting"


def test_a_step_whose_checkpoint_call_fails_keeps_its_record_but_is_not_reported(trainer, monkeypatch):
    """A peer dying during a --replica-sync wait fails the checkpoint call after the update was applied;
    a restart may resume from that step's snapshot and never redo it, so its record must be written —
    also when the step number was seen before (a rollback redoes steps)."""
    from stalwart.train.hooks import StepHook

    reported = []
    monkeypatch.setattr(stalwart, "report", lambda step, **kw: reported.append(step))

    class FailingSave(StepHook):
        armed = False

        def after_step(self, trainer, stats):
            if self.armed:
                raise RuntimeError("Connection closed by peer")

    failing = FailingSave()
    trainer.hooks.insert(trainer.hooks.index(trainer.metrics), failing)
    trainer.train_step()
    trainer.train_step()
    trainer.step, failing.armed = 1, True  # as after a rollback to step 1: step 2 again, and its save fails
    with pytest.raises(RuntimeError, match="closed by peer"):
        trainer.train_step()
    assert trainer.step == 2 and reported == [1, 2], "the failed step is not reported as progress"
    # Written at once (the launcher may stop the process any moment), before any later drain.
    records = [json.loads(x) for x in (Path(trainer.cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("interrupted", False)) for r in records] == [(1, False), (2, False), (2, True)]
    assert records[2]["loss"] > 0
