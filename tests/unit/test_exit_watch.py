"""The agent's monitor wait ends when a worker exits, not at the next tick; an exited worker is not
watched again (its pidfd stays readable), and without pidfds it is the plain sleep."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from stalwart.launch.exit_watch import ExitWatch

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "pidfd_open"), reason="no pidfd_open here")


def sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def timed_wait(watch: ExitWatch, pids: list[int], seconds: float) -> float:
    t0 = time.monotonic()
    watch.wait(pids, seconds)
    return time.monotonic() - t0


def test_a_worker_exit_ends_the_wait_and_is_not_watched_again() -> None:
    watch, short, long = ExitWatch(), sleeper(0.3), sleeper(60)
    try:
        assert timed_wait(watch, [short.pid, long.pid], 30) < 20  # woken by the exit, not the 30 s bound
        assert short.poll() is not None or short.wait(5) == 0
        # the exited one stays readable: not watched again, so the next wait lasts its bound
        assert timed_wait(watch, [short.pid, long.pid], 0.3) >= 0.25
        long.kill()
        assert timed_wait(watch, [short.pid, long.pid], 30) < 20
    finally:
        long.kill()
        long.wait()
        watch.close()


def test_a_new_attempts_processes_replace_the_old_ones_and_a_missing_pid_does_not_block() -> None:
    watch, first = ExitWatch(), sleeper(60)
    try:
        assert timed_wait(watch, [first.pid], 0.1) >= 0.08
        first.kill()
        first.wait()
        assert timed_wait(ExitWatch(), [first.pid], 30) < 20  # reaped: no pidfd, the tick looks at once
        second = sleeper(60)
        assert timed_wait(watch, [second.pid], 0.2) >= 0.15
        assert list(watch._fds) == [second.pid], "the former attempt's pidfd is closed"
        second.kill()
        second.wait()
        assert timed_wait(watch, [], 0.1) >= 0.08  # nothing to watch: the plain sleep
    finally:
        watch.close()


def test_without_pidfds_it_is_the_plain_sleep(monkeypatch) -> None:
    """A kernel or sandbox that refuses pidfds (EPERM, ENOSYS): the plain sleep, from then on."""
    import errno
    import os

    def refused(pid: int) -> int:
        raise OSError(errno.EPERM, "pidfd_open refused")

    monkeypatch.setattr(os, "pidfd_open", refused)
    watch, proc = ExitWatch(), sleeper(0.05)
    try:
        assert timed_wait(watch, [proc.pid], 0.5) >= 0.45  # its exit does not end the wait
        assert watch.supported is False and not watch._fds
        assert timed_wait(watch, [proc.pid], 0.2) >= 0.15
    finally:
        proc.wait()
