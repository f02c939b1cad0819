"""`subprocess.run` for e2e tests that, when the command outlives its timeout, fails the test with
the Python stacks of every process the command started and the tail of its log: a hang in CI then
names where it waited (the rerun a hang needs rarely comes)."""

from __future__ import annotations

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
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    stacks = "\n".join(f"--- pid {p.pid} {' '.join(p.cmdline())[:200]} ---\n{stack_dump(p.pid)}" for p in family)
    for p in family:
        p.kill()
    _, err = proc.communicate()
    head = f"{' '.join(cmd[:5])} … did not end within {timeout} s"
    pytest.fail(f"{head}\n{stacks}\n--- its log ends ---\n{err[-6000:]}", pytrace=False)
