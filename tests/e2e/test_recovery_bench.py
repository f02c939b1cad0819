"""Smoke test of benchmarks/recovery.py: tiny settings, JSON shape and recovery facts, no timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "recovery.py"


def test_recovery_benchmark_smoke(tmp_path):
    """One rank, as on one GPU (`--device cuda --nproc 1`): the faults fall on rank 0 (they fell on a
    rank 1 that did not exist, and no fault fired, on the first GPU run)."""
    cmd = [
        sys.executable,
        str(BENCH),
        "--json",
        "--nproc",
        "1",
        "--repeats",
        "1",
        "--steps",
        "14",
        "--kill-step",
        "8",
        "--dcp-every",
        "5",
        "--hang-step",
        "4",
        "--hang-timeout",
        "2",
        "--configs",
        "stalwart,torchrun_dcp",
        "--timeout",
        "120",
        "--dir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    s, d = result["stalwart"], result["torchrun_dcp"]
    assert {"mttr_s", "regain_s", "lost_steps", "goodput", "hang_detect_s"} <= s.keys()
    assert {"mttr_s", "regain_s", "lost_steps", "goodput"} <= d.keys()
    assert {"mttr_s", "regain_s", "lost_steps", "goodput"} <= result["ratios"].keys()
    assert s["finished"] and d["finished"], "both jobs completed every step after the kill"
    # flash snapshots resume from the killed step itself; DCP every 5 from step 5
    assert s["lost_steps"] == 0 and d["lost_steps"] == 3
    assert s["lost_steps"] < d["lost_steps"]
    [run] = result["runs"]["stalwart"]
    assert run["restore_source"] == "memory" and run["journal"]["kind"] == "sigkill"
    assert all(v > 0 for v in (s["mttr_s"], s["regain_s"], d["mttr_s"], d["regain_s"], s["hang_detect_s"]))
    assert 0 < s["goodput"] < 1 and 0 < d["goodput"] < 1
    # the MTTR split into consecutive intervals, CUDA's own (0 here) between the imports and the process group
    phases = ["detect", "stop", "respawn", "imports", "cuda_init", "pg_init", "build", "restore", "first_step"]
    assert [p for p in run["breakdown_s"] if p in phases] == phases
    assert all(run["breakdown_s"][p] >= 0 for p in phases[1:]), run["breakdown_s"]
    assert sum(run["breakdown_s"][p] for p in phases) == pytest.approx(run["mttr_s"], abs=2e-3)  # each rounded
