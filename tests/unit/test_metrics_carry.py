"""A step's snapshot carries the metrics records not yet written; a restart writes the ones its log lacks.

The end-to-end case (a worker SIGKILLed between its snapshot and its record, restored from memory) is
``tests/e2e/test_ckpt_resume.py``; here the rule itself: which carried records are written (also the
previous step's, still on its way to the host as on CUDA), and how the end of a log whose last line was
torn by a kill is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import stalwart
from stalwart.observe.progress import last_logged_step
from stalwart.train.hooks import StepStats
from stalwart.train.metrics import HostCopy, MetricsHook


class FakeTrainer:
    class sampler:
        consumed = 96

    class timer:
        @staticmethod
        def begin_step(step: int) -> None:
            pass

        @staticmethod
        def resolved() -> list:
            return []


class InFlight(HostCopy):
    """A host copy that never finishes, as on CUDA a step's values before the next step."""

    def ready(self) -> bool:
        return False


def stats(step: int) -> StepStats:
    return StepStats(step, torch.tensor(2.5 + step), torch.tensor(0.75), torch.tensor(0.0), 3e-4)


def hook(out: Path, log_every: int = 1) -> MetricsHook:
    return MetricsHook(
        out, 10, log_every, tokens_per_step=64, world_size=1, flops_per_token=6.0, peak_flops=1e6, main=True
    )


def carried(step: int) -> dict:
    """The state a snapshot of ``step`` holds (what ``TrainingState`` captures and loads back)."""
    h = hook(Path("/nonexistent"))
    h.before_step(FakeTrainer, step)
    h.stage(FakeTrainer, stats(step))
    return h.state_dict()


def log(out: Path, steps: list[int], torn: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)
    (out / "metrics.jsonl").write_text(lines + torn)


def reopened(out: Path, state: dict, start_step: int) -> list[dict]:
    h = hook(out)
    h.load_state_dict(state)
    h.open(start_step, progress=False)
    h.close()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_last_logged_step_skips_a_line_torn_by_a_kill(tmp_path: Path):
    assert last_logged_step(tmp_path / "missing.jsonl") == -1
    log(tmp_path, [1, 2, 3], torn='{"step": 4, "lo')
    assert last_logged_step(tmp_path / "metrics.jsonl") == 3
    log(tmp_path, [])
    assert last_logged_step(tmp_path / "metrics.jsonl") == -1


def test_a_restart_writes_the_restored_steps_record_only_when_the_log_ends_before_it(tmp_path: Path):
    state = carried(5)
    assert isinstance(state["values"], torch.Tensor), "the values ride as a tensor: no host read on the step"
    log(tmp_path / "a", [1, 2, 3, 4])  # the kill came between step 5's snapshot and its record
    got = reopened(tmp_path / "a", state, 5)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    five = got[-1]
    assert five["restored"] is True and (five["loss"], five["grad_norm"], five["lr"]) == (7.5, 0.75, 3e-4)
    assert five["samples_consumed"] == 96 and five["tokens_per_s"] > 0 and five["mfu"] is not None
    assert "checkpoint_s" not in five, "the checkpoint call's time is not known to the snapshot"
    # The record was written before the stop: not again.
    log(tmp_path / "b", [1, 2, 3, 4, 5])
    assert [r["step"] for r in reopened(tmp_path / "b", state, 5)] == [1, 2, 3, 4, 5]
    # A log that went on past it (a rollback, an older checkpoint): nothing added.
    log(tmp_path / "c", [1, 2, 3, 4, 5, 6, 7])
    assert [r["step"] for r in reopened(tmp_path / "c", state, 5)] == [1, 2, 3, 4, 5, 6, 7]
    # No log, or one that ends long before: another run's (a job started from a copy of the checkpoints).
    assert not (tmp_path / "d").exists() and [r["step"] for r in reopened(tmp_path / "d", state, 5)] == []
    log(tmp_path / "e", [1, 2])
    assert [r["step"] for r in reopened(tmp_path / "e", state, 5)] == [1, 2]


def test_the_previous_steps_record_still_on_its_way_to_the_host_is_carried_too(tmp_path: Path, monkeypatch):
    from stalwart.train import metrics

    monkeypatch.setattr(metrics, "HostCopy", InFlight)
    monkeypatch.setattr(stalwart, "report", lambda *a, **k: None)
    h = hook(tmp_path / "run", log_every=100)  # no log step: nothing waits for the values
    h.open(0, progress=False)
    for step in (1, 2, 3, 4):  # as the trainer runs a step: stage, then the hooks (metrics last)
        h.before_step(FakeTrainer, step)
        h.stage(FakeTrainer, stats(step))
        h.after_step(FakeTrainer, stats(step))
    h.before_step(FakeTrainer, 5)
    h.stage(FakeTrainer, stats(5))  # the snapshot of step 5; the process is killed before its record
    state = h.state_dict()
    assert [r["step"] for r in json.loads(state["records"])] == [4, 5]
    log(tmp_path / "restart", [1, 2, 3])  # what reached the file: step 4 was still waiting for its values
    got = reopened(tmp_path / "restart", state, 5)
    assert [(r["step"], r.get("restored", False)) for r in got] == [
        (1, False),
        (2, False),
        (3, False),
        (4, True),
        (5, True),
    ]
    assert [r["loss"] for r in got[3:]] == [6.5, 7.5] and "checkpoint_s" in got[3] and "checkpoint_s" not in got[4]


def test_a_restore_from_a_step_the_snapshot_does_not_describe_writes_nothing(tmp_path: Path):
    log(tmp_path, [1, 2, 3])
    assert [r["step"] for r in reopened(tmp_path, carried(5), 4)] == [1, 2, 3]  # another step's record
    empty = hook(tmp_path).state_dict()  # a restore's template before any step, loaded unchanged
    assert empty["step"] == 0 and set(empty) == set(carried(5)) and empty["values"].shape == carried(5)["values"].shape
    assert [r["step"] for r in reopened(tmp_path, empty, 4)] == [1, 2, 3]
