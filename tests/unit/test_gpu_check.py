"""benchmarks/gpu_check.py's verdicts (issue 17's acceptance) from a benchmark result, no GPU needed;
a part that outlives its timeout is stopped; gpu_step.py refuses a CPU (without --smoke) with a clear
message instead of a traceback. tests/e2e/test_gpu_bench_cpu.py runs the whole benchmark on the CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

TESTS = {"rc": 0, "passed": 9, "failed": 0, "skipped": 0, "failed_tests": [], "figures": []}


def bench(mfu: float, base_mfu: float, blocking: float) -> dict:
    step_s = 0.2
    return {
        "stalwart": {"mfu": mfu, "tokens_per_s": 1.0},
        "baseline": {"mfu": base_mfu, "tokens_per_s": 1.0},
        "checkpoint": {
            "blocking_fraction": blocking,
            "blocking_ms_per_save": blocking * step_s * 1e3,
            "step_s": step_s,
        },
        "restore": {"restored_from": "memory", "restore_s": 0.5},
    }


def failed(rows: list[tuple[str, bool, str]]) -> list[str]:
    return [what for what, ok, _ in rows if not ok]


def test_verdicts_follow_the_acceptance_thresholds():
    assert failed(gpu_check.verdicts(TESTS, bench(0.40, 0.41, 0.005))) == []
    assert failed(gpu_check.verdicts(TESTS, bench(0.30, 0.41, 0.005))) == ["MFU ≥ 0.95 × plain loop"]
    assert failed(gpu_check.verdicts(TESTS, bench(0.40, 0.41, 0.02))) == ["snapshot blocking ≤ 1 % of a step"]
    skipped_only = dict(TESTS, passed=0, skipped=9)
    assert failed(gpu_check.verdicts(skipped_only, bench(0.40, 0.41, 0.005))) == ["tests/gpu green"]
    timed_out = dict(TESTS, rc=None, timed_out=True)
    assert failed(gpu_check.verdicts(timed_out, bench(0.40, 0.41, 0.005))) == ["tests/gpu green"]


def test_a_missing_or_failed_section_fails_its_verdicts_with_the_reason():
    everything = ["MFU ≥ 0.95 × plain loop", "snapshot blocking ≤ 1 % of a step", "restore from memory"]
    rows = gpu_check.verdicts(TESTS, {"error": "timed out after 150 s (sections done: [])"})
    assert failed(rows) == everything and "timed out after 150 s" in rows[1][2]
    b = dict(bench(0.40, 0.41, 0.005), checkpoint={"skipped": "memory snapshots need 8 GB in /dev/shm"})
    b["restore"] = {"error": "CUDA out of memory"}
    rows = gpu_check.verdicts(TESTS, b)
    assert failed(rows) == everything[1:]
    assert "need 8 GB" in rows[2][2] and "out of memory" in rows[3][2]


def test_a_part_past_its_timeout_is_stopped_with_its_process_group(tmp_path):
    t0 = time.perf_counter()
    cmd = ["bash", "-c", "sleep 60 & echo started; wait"]
    rc, took = gpu_check.run_logged(cmd, tmp_path / "log", timeout=1.0)
    assert rc is None and took < 30 and time.perf_counter() - t0 < 30
    assert (tmp_path / "log").read_text() == "started\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_benchmark_says_it_needs_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py")], capture_output=True, text=True)
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr, proc.stderr[-2000:]
