"""`subprocess.run` for e2e tests that, when the command outlives its timeout, fails the test with
the Python stacks of every process the command started and the tail of its log: a hang in CI then
names where it waited (the rerun a hang needs rarely comes)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import psutil
import pytest

from stalwart.launch.evidence import stack_dump


def run_or_dump(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    else:
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    root = psutil.Process(proc.pid)
    stacks = "\n".join(_stacks(p) for p in [root, *root.children(recursive=True)])
    kill_tree(proc)
    _, err = proc.communicate()
    head = f"{' '.join(cmd[:5])} … did not end within {timeout} s"
    pytest.fail(f"{head}\n{stacks}\n--- its log ends ---\n{err[-6000:]}", pytrace=False)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every process it started (TorchElastic's workers run in sessions of their
    own, so killing the launcher alone could leave them), then reap it."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):  # it may end on its own meanwhile
                p.kill()
    proc.wait()


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen) -> Iterator[None]:
    """Whatever of ``procs`` still runs when the block ends (a failed assertion, a timeout) is killed
    with its children: a job that outlived its test went on restarting its workers for 20 minutes."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)


def _stacks(process: psutil.Process) -> str:
    try:
        return f"--- pid {process.pid} {' '.join(process.cmdline())[:200]} ---\n{stack_dump(process.pid)}"
    except psutil.NoSuchProcess:  # ended (or a zombie) between the listing and the dump
        return f"--- pid {process.pid}: ended before its dump ---"
