"""Observability for real: separate processes, gloo, the installed CLI. One injected 200 ms stall shows
at exactly its (step, rank) in the per-rank records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.observe.records import read_meta, read_records

pytestmark = pytest.mark.e2e
STEPS, STALL_STEP, STALL_RANK = 6, 4, 1


@pytest.fixture(scope="module")
def stalled_run(stdlib_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("observe")
    env = dict(
        os.environ,
        STALWART_CHAOS=f"delay:at=forward:step={STALL_STEP}:rank={STALL_RANK}:seconds=0.2",
        STALWART_CHAOS_DIR=str(out / "chaos"),
    )
    args = ["train", "--config", "configs/debug.toml", "--nproc", "2", "--json", f"--data.dir={stdlib_data}"]
    args += ["--data.seq_len=32", f"--train.steps={STEPS}", "--train.warmup_steps=2", f"--train.out_dir={out}"]
    result = subprocess.run(
        [sys.executable, "-m", "stalwart", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_a_stall_shows_at_exactly_its_step_and_rank(stalled_run: Path):
    records = {(r["step"], r["rank"]): r for r in read_records(stalled_run)}
    assert set(records) == {(s, r) for s in range(1, STEPS + 1) for r in (0, 1)}, "every rank, every step"
    forward = {key: r["ms"]["forward"] for key, r in records.items()}
    assert max(forward, key=forward.get) == (STALL_STEP, STALL_RANK)
    assert forward[(STALL_STEP, STALL_RANK)] >= 200.0
    stalled = records[(STALL_STEP, STALL_RANK)]
    assert stalled["ms"]["step"] >= stalled["ms"]["forward"] and stalled["compute_ms"] >= 200.0
    for r in records.values():  # the record carries the step's numbers, not just times
        assert {"data", "forward", "backward", "grad_clip", "optimizer", "checkpoint", "step"} <= set(r["ms"])
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["mem_mb"] > 0
        assert r["spans"][0][0] == "data"
    assert records[(3, 0)]["loss"] == records[(3, 1)]["loss"], "the global loss, the same on every rank"
    assert {m["coords"]["dp"] for m in read_meta(stalled_run).values()} == {0, 1}
