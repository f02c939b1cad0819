"""`stalwart run --share-with`: an opportunistic job beside a production job on the same cores (issue 29).

The production job (1 worker) and the guest (3 workers) compute the same exact integer chain on a 2-core
box, so unthrottled the guest would take half of the production job's core (2× its step time).
The guest's agent must cut the guest's duty cycle whenever the production job runs over its bound, the
guest must still progress, and every worker, stopped and continued hundreds of times, must end with the
production job's result."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_chaos_cli import stalwart

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent / "scripts" / "busy_steps.py"
STEPS, BOUND = 300, 0.4


def _start(run_dir: Path, out: Path, nproc: int, *run_args: str, seconds: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--run-dir", str(run_dir), "--summary-json", str(run_dir / "summary.json"), *run_args]
    cmd += [str(SCRIPT), "--out", str(out), "--steps", str(STEPS), "--size", "160", "--min-seconds", str(seconds)]
    run_dir.mkdir(exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:  # a pipe nobody reads could fill up
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _tail(log: Path) -> str:
    return log.read_text()[-4000:]


def _steps(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines()]


def _result(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"result-rank{rank}.json").read_text())


def test_a_guest_yields_when_over_the_bound_progresses_and_both_jobs_end_with_the_same_result(tmp_path):
    host_run, guest_run = tmp_path / "host-run", tmp_path / "guest-run"
    host_run.mkdir()
    # Both at once: the guest runs free until the production job trains, then yields to it.
    share = ("--share-with", str(host_run), "--share-bound", str(BOUND))
    guest = _start(guest_run, tmp_path / "guest", 3, *share, seconds=16)
    host = _start(host_run, tmp_path / "host", 1, seconds=10)
    try:
        host.wait(timeout=180)
        guest.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"host: {_tail(tmp_path / 'host-run.log')}\nguest: {_tail(tmp_path / 'guest-run.log')}")
    finally:
        for proc in (host, guest):
            if proc.poll() is None:
                proc.kill()
    assert host.returncode == 0, _tail(tmp_path / "host-run.log")
    assert guest.returncode == 0, _tail(tmp_path / "guest-run.log")

    # Outcomes: every guest worker, stopped and continued throughout, ends with the production job's result.
    expected = _result(tmp_path / "host")
    assert expected["steps"] == STEPS
    assert [_result(tmp_path / "guest", r) for r in (0, 1, 2)] == [expected] * 3

    windows = [json.loads(line) for line in (guest_run / "share.jsonl").read_text().splitlines()]
    probes = [w for w in windows if w["phase"] == "probe"]
    shares = [w for w in windows if w["phase"] == "share"]
    assert probes and len(shares) >= 3, windows
    # The control law, window by window, with real processes: every share window over the bound made the
    # next one's duty lower (down to held), and there were such windows (the guest really competed).
    # The bound itself is not asserted here: on CI's 2 cores a neighbouring test moves the production
    # job's step time by ±35 % within a second (CI9: probes 0.0114-0.0157 s), more than any bound, so it
    # is asserted in tests/unit/test_share.py (interference the test controls) and measured on a quiet
    # box by benchmarks/share_node.py.
    over = [
        (a, b)
        for a, b in itertools.pairwise(windows)
        if a["phase"] == b["phase"] == "share" and a["host_step_s"] > (1 + BOUND) * a["host_alone_s"]
    ]
    assert over, windows
    assert all(b["duty"] < a["duty"] or a["duty"] == 0.0 for a, b in over), windows
    host_steps = _steps(tmp_path / "host")
    # ... and it progressed while the production job trained.
    trained = (host_steps[0]["t0"], host_steps[-1]["t1"])
    assert sum(trained[0] < s["t0"] and s["t1"] < trained[1] for s in _steps(tmp_path / "guest")) >= 10
    summary = json.loads((guest_run / "summary.json").read_text())["share"]
    assert summary["bound"] == BOUND and summary["windows"]["share"] == len(shares), summary


def test_share_with_a_missing_run_directory_is_refused_before_anything_starts(tmp_path):
    missing = tmp_path / "no-such-run"
    proc = stalwart("run", "--standalone", "--share-with", str(missing), str(SCRIPT), "--out", str(tmp_path))
    assert proc.returncode != 0
    assert f"--share-with {missing} is not a directory" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "steps-rank0.jsonl").exists()
