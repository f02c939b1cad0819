"""TensorBoard events: rank 0's step records as scalars, a resumed run replacing the redone steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stalwart.observe.tensorboard import TensorBoardSink, wanted


def scalars(log_dir: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step drawn twice: {steps}"
    return {e.step: e.value for e in events}


def test_a_resumed_run_replaces_the_steps_it_redoes(tmp_path: Path):
    first = TensorBoardSink(tmp_path, start_step=0)
    for step in range(1, 7):
        first.write({"step": step, "loss": 10.0 + step, "lr": 1e-3})
    first.close()
    resumed = TensorBoardSink(tmp_path, start_step=3)  # restored at step 3: steps 4.. are done again
    for step in range(4, 9):
        resumed.write({"step": step, "loss": 20.0 + step, "lr": 1e-3})
        resumed.write_sections({"step": step, "forward": 0.25, "compute_s": 0.25, "wait_s": 0.0, "spans": []})
    resumed.close()
    assert scalars(tmp_path, "train/loss") == {1: 11.0, 2: 12.0, 3: 13.0, **{s: 20.0 + s for s in range(4, 9)}}
    assert scalars(tmp_path, "sections_ms/forward") == {s: 250.0 for s in range(4, 9)}
    assert set(scalars(tmp_path, "sections_ms/compute")) == set(range(4, 9))


def test_one_event_per_step_reads_back_as_add_scalar_per_value_would(tmp_path: Path):
    from torch.utils.tensorboard import SummaryWriter

    from stalwart.observe.tensorboard import SCALARS

    sink, reference = TensorBoardSink(tmp_path / "sink", 0), SummaryWriter(str(tmp_path / "reference"))
    for step in range(1, 26):  # flushed at 10 and 20 as at log steps; the rest by close
        record = {"step": step, "loss": 5.0 - step / 10, "lr": 1e-3 * step, "tokens_per_s": 2500.0 + step}
        sections = {"step": step, "forward": 0.01 * step, "compute_s": 0.02, "wait_s": 0.001, "spans": []}
        sink.write(record)
        sink.write_sections(sections)
        if step % 10 == 0:
            sink.flush()
        for key, value in record.items():
            if key in SCALARS:
                reference.add_scalar(SCALARS[key], value, step)
        for name, tag in (("forward", "forward"), ("compute_s", "compute"), ("wait_s", "wait")):
            reference.add_scalar(f"sections_ms/{tag}", sections[name] * 1e3, step)
    sink.close()
    reference.close()
    acc = EventAccumulator(str(tmp_path / "reference"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert len(tags) == 6
    for tag in tags:
        assert scalars(tmp_path / "sink", tag) == scalars(tmp_path / "reference", tag), tag


def test_the_setting_is_checked():
    assert wanted("auto") and wanted("on") and not wanted("off")


def test_stalwart_train_writes_the_metrics_it_logs(stdlib_data: Path, tmp_path: Path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "stalwart", "train", "--config", "configs/debug.toml", "--nproc", "1"]
    cmd += [f"--data.dir={stdlib_data}", "--data.seq_len=32", "--train.steps=5", "--train.warmup_steps=1"]
    cmd += [f"--train.out_dir={out}", "--train.tensorboard=on"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = scalars(out / "tensorboard", "train/loss")
    assert sorted(loss) == [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    assert all(loss[r["step"]] == pytest.approx(r["loss"], rel=1e-6) for r in logged)
    assert set(scalars(out / "tensorboard", "sections_ms/forward")) == {1, 2, 3, 4, 5}
