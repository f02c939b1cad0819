"""Smoke test of benchmarks/step_overhead.py: tiny settings, every line of both sides, the in-process
step comparison and the TensorBoard timing runs, the JSON has its shape; no timing is asserted
(benchmarks/ holds the claim, this only keeps the script runnable)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead.py"


def test_step_overhead_benchmark_smoke():
    cmd = [sys.executable, str(BENCH), "--json", "--repeats", "1", "--steps", "3", "--global-batch", "4"]
    cmd += ["--micro-batch", "2", "--seq-len", "32", "--tb-steps", "200", "--blocks", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["stalwart_runs"]) == len(result["baseline_runs"]) == 1, "both sides ran"
    assert all(t > 0 for t in result["stalwart_runs"] + result["baseline_runs"])
    assert result["ratio"] == pytest.approx(result["stalwart_tokens_per_s"] / result["baseline_tokens_per_s"])
    tb = result["tensorboard"]  # the test extra installs tensorboard: the in-process timing ran
    assert tb is not None and tb["one_event_per_step_us"] > 0 and tb["add_scalar_per_value_us"] > 0
    assert tb["one_event_per_step_fraction_of_step"] == pytest.approx(
        tb["one_event_per_step_us"] / 1e3 / result["stalwart_median_step_ms"]
    )
    steps = result["in_process"]  # both steps ran in one job: 2 blocks × 8 counted steps per side
    assert steps["blocks"] == 2 and all(
        steps[f"{side}_{k}_ms"] > 0 for side in ("stalwart", "plain") for k in ("wall", "cpu", "own")
    )
    for side in ("stalwart", "plain"):  # own time: the step less its forward, loss, backward, clip, update
        assert steps[f"{side}_own_ms"] < steps[f"{side}_wall_ms"]
    assert steps["stalwart_extra_ms"] == pytest.approx(steps["stalwart_own_ms"] - steps["plain_own_ms"])
    assert steps["wall_ratio"] == pytest.approx(steps["plain_wall_ms"] / steps["stalwart_wall_ms"])
    assert steps["cpu_ratio"] == pytest.approx(steps["plain_cpu_ms"] / steps["stalwart_cpu_ms"])
