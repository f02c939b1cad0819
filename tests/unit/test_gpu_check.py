"""benchmarks/gpu_check.py's verdicts (issue 17's acceptance) from a benchmark result, no GPU needed;
and gpu_step.py refuses a CPU with a clear message instead of a traceback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

TESTS = {"rc": 0, "passed": 9, "failed": 0, "skipped": 0, "failed_tests": [], "figures": []}


def bench(mfu: float, base_mfu: float, blocking: float) -> dict:
    return {
        "stalwart": {"mfu": mfu, "tokens_per_s": 1.0},
        "baseline": {"mfu": base_mfu, "tokens_per_s": 1.0},
        "throughput_ratio": mfu / base_mfu,
        "checkpoint": {"blocking_fraction": blocking, "restored_from": "memory", "restore_s": 0.5},
    }


def failed(rows: list[tuple[str, bool, str]]) -> list[str]:
    return [what for what, ok, _ in rows if not ok]


def test_verdicts_follow_the_acceptance_thresholds():
    assert failed(gpu_check.verdicts(TESTS, bench(0.40, 0.41, 0.005))) == []
    assert failed(gpu_check.verdicts(TESTS, bench(0.30, 0.41, 0.005))) == ["MFU ≥ 0.95 × baseline"]
    assert failed(gpu_check.verdicts(TESTS, bench(0.40, 0.41, 0.02))) == ["snapshot blocking ≤ 1 % of a step"]
    skipped_only = dict(TESTS, passed=0, skipped=9)
    assert failed(gpu_check.verdicts(skipped_only, bench(0.40, 0.41, 0.005))) == ["tests/gpu green"]
    assert failed(gpu_check.verdicts(TESTS, {"error": "out of memory"})) == ["benchmark ran"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_benchmark_says_it_needs_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py")], capture_output=True, text=True)
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr, proc.stderr[-2000:]
