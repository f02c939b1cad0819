"""``runtime.sigterm``: a SIGTERM finishes what must not be cut (bounded), then the process dies of
SIGTERM, also when its main thread is held in C; nothing changes for scripts with their own handler or
for forked children. Real processes and real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from stalwart.runtime.sigterm import FINISH_BOUND_S

PRELUDE = """
import ctypes, os, signal, sys, time
from pathlib import Path
from stalwart.runtime.sigterm import finish_before_sigterm, installed
out = Path(sys.argv[1])
"""


def start(body: str, out: Path) -> subprocess.Popen:
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.communicate(timeout=30)
    return proc


def terminate(proc: subprocess.Popen, timeout: float = 20.0) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=timeout)
    return time.monotonic() - t0


def test_a_sigterm_finishes_the_work_first_even_with_the_main_thread_held_in_c(tmp_path):
    """The main thread blocks SIGTERM and sits in libc's sleep (as in a CUDA sync or a gloo wait): the
    interpreter never runs a handler there, yet the finisher runs and the process dies of SIGTERM."""
    out = tmp_path / "finished"
    proc = start(
        """
        def finish(timeout):
            time.sleep(0.5)
            out.write_text(f"{timeout:.1f}")
        finish_before_sigterm(finish)
        assert installed()
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # delivered to another thread only
        print("ready", flush=True)
        ctypes.CDLL(None).sleep(120)
        """,
        out,
    )
    took = terminate(proc)
    assert proc.returncode == -signal.SIGTERM, "the process dies of SIGTERM, as without the handler"
    assert FINISH_BOUND_S - 1.0 < float(out.read_text()) <= FINISH_BOUND_S, "the finisher ran, with the bound"
    assert 0.5 <= took < 10, took


def test_a_sigterm_in_python_code_runs_the_finisher_and_a_removed_one_never(tmp_path):
    out = tmp_path / "finished"
    proc = start(
        """
        import threading
        def finish(timeout):
            out.write_text(threading.current_thread().name)
        forget = finish_before_sigterm(lambda timeout: out.with_suffix(".removed").write_text("ran"))
        finish_before_sigterm(finish)
        forget()
        print("ready", flush=True)
        while True:
            sum(range(1000))
        """,
        out,
    )
    terminate(proc)
    assert proc.returncode == -signal.SIGTERM
    assert out.read_text() in ("MainThread", "stalwart-sigterm"), "one of the two paths ran it"
    assert not out.with_suffix(".removed").exists()


def test_a_finisher_that_overstays_is_cut_at_the_bound(tmp_path):
    proc = start(
        """
        finish_before_sigterm(lambda timeout: time.sleep(120))
        print("ready", flush=True)
        time.sleep(120)
        """,
        tmp_path / "unused",
    )
    took = terminate(proc)
    assert proc.returncode == -signal.SIGTERM
    assert FINISH_BOUND_S <= took < FINISH_BOUND_S + 5, took


def test_a_forked_child_dies_of_sigterm_at_once_and_its_signal_never_reaches_the_parent(tmp_path):
    """A forked child of a process with the handler (a DataLoader worker) has SIGTERM's default, and its
    signal does not reach the parent's thread through the inherited wakeup fd."""
    out = tmp_path / "parent"
    proc = start(
        """
        finish_before_sigterm(lambda timeout: out.write_text("parent finished"))
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        assert time.monotonic() - t0 < 2, "the child did not wait for anything"
        time.sleep(1.0)  # a byte that reached our fd would have ended us by now
        assert not out.exists()
        print("ready", flush=True)
        """,
        out,
    )
    proc.wait(timeout=30)
    assert proc.returncode == 0


def test_a_scripts_own_handler_stays(tmp_path):
    out = tmp_path / "handled"
    proc = start(
        """
        signal.signal(signal.SIGTERM, lambda *_: out.write_text("theirs"))
        finish_before_sigterm(lambda timeout: None)
        assert not installed()
        print("ready", flush=True)
        while not out.exists():
            time.sleep(0.05)
        """,
        out,
    )
    terminate(proc)
    assert proc.returncode == 0 and out.read_text() == "theirs"


def test_the_last_finisher_removed_gives_sigterm_its_default_back(tmp_path):
    """In a process that outlives its Checkpointer (a test process, a notebook) SIGTERM's meaning and the
    wakeup fd are back as found, and the thread is gone."""
    proc = start(
        """
        import threading
        forget_a = finish_before_sigterm(lambda timeout: None)
        forget_b = finish_before_sigterm(lambda timeout: None)
        forget_a()
        assert installed() and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        forget_b()
        assert not installed() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.set_wakeup_fd(-1) == -1
        deadline = time.monotonic() + 10
        while [t for t in threading.enumerate() if t.name == "stalwart-sigterm"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [t for t in threading.enumerate() if t.name == "stalwart-sigterm"]
        forget_c = finish_before_sigterm(lambda timeout: out.write_text("again"))
        assert installed()
        print("ready", flush=True)
        time.sleep(120)
        """,
        tmp_path / "again",
    )
    terminate(proc)
    assert proc.returncode == -signal.SIGTERM and (tmp_path / "again").read_text() == "again"


def test_a_handler_put_back_after_the_last_finisher_acts_as_the_default(tmp_path):
    """A framework that wrapped the handler restores it after the Checkpointer closed (Lightning's
    teardown): SIGTERM then ends the process at once, as its default does, without waiting for anything."""
    proc = start(
        """
        import stalwart.runtime.sigterm as sigterm
        finish_before_sigterm(lambda timeout: out.write_text("ran"))()
        signal.signal(signal.SIGTERM, sigterm._on_signal)  # put back by the framework
        print("ready", flush=True)
        time.sleep(120)
        """,
        tmp_path / "ran",
    )
    assert terminate(proc) < 2.0
    assert proc.returncode == -signal.SIGTERM and not (tmp_path / "ran").exists()


def test_a_second_sigterm_and_a_handler_raising_meanwhile_change_nothing(tmp_path):
    """The copy takes 1 s. Meanwhile a second SIGTERM comes (a scheduler signalling every process), and
    another handler raises on the main thread (torch's SIGCHLD handler when DataLoader workers die of
    the same SIGTERM): the finisher still completes, the script does not run on (it would write
    "ran on"), and the process dies of SIGTERM once the finisher is done, long before the backstop."""
    out = tmp_path / "finished"
    proc = start(
        """
        def finish(timeout):
            time.sleep(1.0)
            out.write_text("done")
        def boom(*_):
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated")
        finish_before_sigterm(finish)
        signal.signal(signal.SIGUSR1, boom)
        print("ready", flush=True)
        try:
            while True:
                sum(range(1000))
        except BaseException:
            out.with_suffix(".ran_on").write_text("ran on")
            raise
        """,
        out,
    )
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=20)
    took = time.monotonic() - t0
    assert proc.returncode == -signal.SIGTERM and out.read_text() == "done"
    assert not out.with_suffix(".ran_on").exists(), "the script ran on after the SIGTERM"
    assert 1.0 <= took < FINISH_BOUND_S + 0.5, took
