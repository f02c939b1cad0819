"""`subprocess.run` for e2e tests that, when the command outlives its timeout, fails the test with
the Python stacks of every process the command started and the tail of its log: a hang in CI then
names where it waited (the rerun a hang needs rarely comes)."""

from __future__ import annotations

import contextlib
import subprocess

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
    family = [root, *root.children(recursive=True)]
    stacks = "\n".join(_stacks(p) for p in family)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):  # it may end on its own meanwhile
            p.kill()
    _, err = proc.communicate()
    head = f"{' '.join(cmd[:5])} … did not end within {timeout} s"
    pytest.fail(f"{head}\n{stacks}\n--- its log ends ---\n{err[-6000:]}", pytrace=False)


def _stacks(process: psutil.Process) -> str:
    try:
        return f"--- pid {process.pid} {' '.join(process.cmdline())[:200]} ---\n{stack_dump(process.pid)}"
    except psutil.NoSuchProcess:  # ended (or a zombie) between the listing and the dump
        return f"--- pid {process.pid}: ended before its dump ---"
