"""The share governor's control loop against a production job whose slowdown is known: its step sleeps
``BASE`` plus ``BASE`` × the share of a CPU a real busy guest process used meanwhile. So the guest may run
at most ``BOUND`` of the time, and the governor has to find that out from step times alone."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stalwart.health.throttle import Throttle, cpu_ns
from stalwart.launch.client import ADDRESS_FILE
from stalwart.launch.share import HostSteps, ShareGovernor, Tuning
from stalwart.runtime.progress import PHASES, ProgressWriter

BASE, BOUND = 0.02, 0.4


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def busy_guest():
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def _production_job(run_dir: Path, guest_pid: int, stop: threading.Event) -> None:
    """Steps whose time grows with the guest's CPU use, reported as a worker under `stalwart run` does."""
    (run_dir / ADDRESS_FILE).write_text(json.dumps({"node_id": "n0"}))
    writer = ProgressWriter(run_dir / "progress" / "n0", 0)
    step = 0
    while not stop.is_set():
        t0, used0 = time.monotonic(), cpu_ns(guest_pid) or 0
        time.sleep(BASE)
        share = ((cpu_ns(guest_pid) or 0) - used0) * 1e-9 / (time.monotonic() - t0)
        time.sleep(BASE * min(share, 1.0))
        step += 1
        writer.report(step)
    writer.set_phase("done")
    assert PHASES.index("done") >= 0


def test_the_governor_finds_the_duty_cycle_that_keeps_the_production_job_within_its_bound(tmp_path, busy_guest):
    stop = threading.Event()
    host = threading.Thread(target=_production_job, args=(tmp_path, busy_guest.pid, stop), daemon=True)
    host.start()
    tuning = Tuning(window_steps=4, window_s=0.2)
    governor = ShareGovernor(lambda: [busy_guest.pid], HostSteps(tmp_path), BOUND, tmp_path / "share.jsonl", tuning)
    governor.start()
    try:
        time.sleep(6.0)
    finally:
        stop.set()
        host.join(5)
    time.sleep(governor.tuning.idle_s + 0.5)  # the production job is done: the guest runs free
    assert governor.factor == 1.0 and _state(busy_guest.pid) in "RS"
    governor.close()
    summary = governor.summary()
    shares = [w for w in governor.windows if w.phase == "share"]
    assert summary["windows"]["probe"] >= 2 and len(shares) >= 8, summary
    # Within the bound (what the step times say; a sleep-based step has little noise of its own) …
    assert summary["host_slowdown"] <= 1 + BOUND + 0.1, summary
    # … and the guest got what the bound leaves: neither held for good nor let loose.
    late = [w.duty for w in shares[len(shares) // 2 :]]
    assert 0.1 <= statistics.fmean(late) <= 0.85, [w.duty for w in shares]
    assert governor.windows[-1].phase == "idle"  # it ended free (and may have started so, before a report)
    assert [json.loads(line)["phase"] for line in (tmp_path / "share.jsonl").read_text().splitlines()] == [
        w.phase for w in governor.windows
    ]


def test_a_held_process_is_stopped_until_released_and_the_held_time_is_accounted(busy_guest):
    t0 = time.time()  # before the start: its thread may hold the guest before this thread runs again
    throttle = Throttle(lambda: [busy_guest.pid], math.inf).start()
    try:
        deadline = time.monotonic() + 10
        while _state(busy_guest.pid) != "T":
            assert time.monotonic() < deadline, "never stopped"
            time.sleep(0.01)
        time.sleep(0.5)
        held = throttle.stopped_since(t0)
        assert 0.45 <= held <= time.time() - t0, held
        throttle.set_factor(1.0)
        deadline = time.monotonic() + 10
        while _state(busy_guest.pid) == "T":
            assert time.monotonic() < deadline, "never continued"
            time.sleep(0.01)
        after = time.time()
        time.sleep(0.3)
        assert throttle.stopped_since(after) == 0.0  # free: nothing held since
        assert throttle.stopped_since(t0) == pytest.approx(throttle.stopped_s)
        assert throttle.stopped_since(t0 + 0.2) == pytest.approx(throttle.stopped_s - 0.2, abs=0.05)
    finally:
        throttle.close()
    with pytest.raises(ValueError, match="≥ 1 or inf"):
        throttle.set_factor(0.5)
    assert os.path.exists(f"/proc/{busy_guest.pid}")


def test_a_failing_governor_leaves_the_guest_free_and_says_so(tmp_path, caplog):
    class Broken(HostSteps):
        def read(self):
            raise RuntimeError("unreadable records")

    governor = ShareGovernor(lambda: [], Broken(tmp_path), BOUND, tmp_path / "share.jsonl")
    with caplog.at_level("ERROR", logger="stalwart.share"):
        governor.start()
        governor._governor.join(5)
    governor.close()
    assert governor.factor == 1.0
    assert "the governor stopped; this job now runs unthrottled" in caplog.text
    assert "unreadable records" in caplog.text


def test_a_factor_changed_between_a_ticks_check_and_its_debt_never_leaves_the_guest_stopped(busy_guest):
    """CI's hang: the governor set inf after the tick saw a finite factor; the tick owed inf seconds, its
    thread died of OverflowError with the workers stopped, and the guest never ended."""
    flips = {"n": 0}

    def pids() -> list[int]:  # read inside the tick's debt: the governor's change lands just there
        flips["n"] += 1
        if flips["n"] < 120:
            throttle.set_factor(math.inf if flips["n"] % 2 else 4.0)
        return [busy_guest.pid]

    throttle = Throttle(pids, 4.0)
    throttle.start()
    try:
        deadline = time.monotonic() + 20
        while flips["n"] < 120:
            assert time.monotonic() < deadline and throttle._thread.is_alive(), flips
            time.sleep(0.05)
        throttle.set_factor(1.0)
        time.sleep(0.6)  # one stop at most MAX_STOP_S, then free
        used0, until = cpu_ns(busy_guest.pid), time.monotonic() + 10
        # it computes again: 0.1 s of CPU (within 10 s: a loaded box shares its cores with the guest)
        while (cpu_ns(busy_guest.pid) - used0) * 1e-9 <= 0.1:
            assert time.monotonic() < until, "the guest stays stopped"
            time.sleep(0.1)
        assert throttle._thread.is_alive() and _state(busy_guest.pid) in "RS"
    finally:
        throttle.close()
