"""A cold-started worker runs in place of the shim (same pid) and is killed when its agent dies."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from stalwart.launch import die_with_agent

AGENT = """
import subprocess, sys, time
from stalwart.launch import die_with_agent
cmd, args = die_with_agent.entrypoint("sleep", ["600"])
worker = subprocess.Popen([cmd, *args], start_new_session=True)  # as TorchElastic starts workers
print(worker.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_worker_execs_in_place_and_dies_with_the_agent():
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True)
    worker = int(agent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(worker).name() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(worker).cmdline() == ["sleep", "600"]  # the same pid runs the command itself
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker), "the worker outlived its agent"
    finally:
        agent.kill()
        if _running(worker):
            psutil.Process(worker).kill()


def test_entrypoint_passes_the_command_through():
    cmd, args = die_with_agent.entrypoint(sys.executable, ["-u", "-m", "stalwart", "train"])
    assert cmd == sys.executable and args[0] == "-S" and args[-5:-4] == [sys.executable]
    assert args[-4:] == ["-u", "-m", "stalwart", "train"]
