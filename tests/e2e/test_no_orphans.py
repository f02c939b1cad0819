"""After `stalwart run` ends — success, a worker failure, Ctrl-C, or the agent SIGKILLed — no process it
started is left: not the zygote, the keeper, the workers nor their children (warm-started workers die
with the zygote, cold-started ones with the agent).

The process tree is recorded while the job runs (the agent's descendants, and any process whose
command line names this job's node id or run directory), then every recorded process must be gone
within a few seconds of the agent."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Self

import psutil
import pytest

from stalwart.checkpoint import Storage
from stalwart.checkpoint.shm import user_dir

pytestmark = pytest.mark.e2e
GONE_WITHIN_S = 15.0  # the keeper may first save on failure (a debug model: well under a second)


class ProcessWatch:
    """Every process seen in the job's tree, by (pid, create time) so a reused pid is not confused."""

    def __init__(self, agent: int, marks: list[str]) -> None:
        self.agent, self.marks = agent, marks
        self.seen: dict[tuple[int, float], str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _record(self, proc: psutil.Process) -> None:
        """The latest command line wins: a child seen between fork and exec still shows its parent's."""
        try:
            cmdline = " ".join(proc.cmdline())
            key = (proc.pid, proc.create_time())
        except psutil.Error:
            return
        if cmdline or key not in self.seen:
            self.seen[key] = cmdline

    def scan(self) -> None:
        try:
            for child in psutil.Process(self.agent).children(recursive=True):
                self._record(child)
        except psutil.Error:
            pass
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid != self.agent and any(mark in cmdline for mark in self.marks):
                self._record(proc)

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.scan()
            self.stop.wait(0.1)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()

    def alive(self) -> dict[int, str]:
        out = {}
        for (pid, created), cmdline in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    out[pid] = cmdline
            except psutil.Error:
                pass
        return out


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the job exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize(
    "ending, warm",
    [("success", "on"), ("worker-failure", "on"), ("ctrl-c", "on"), ("agent-sigkill", "on"), ("agent-sigkill", "off")],
)
def test_nothing_outlives_the_agent(stdlib_data, tmp_path, ending, warm):
    node_id = f"orphans-{uuid.uuid4().hex[:8]}"
    out, run_dir, log = tmp_path / "out", tmp_path / "run", tmp_path / "run.log"
    steps = 4 if ending in ("success", "worker-failure") else 10_000  # the others are interrupted
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--node-id",
        node_id,
        "--run-dir",
        str(run_dir),
        "--warm-start",
        warm,
        *(["--chaos", "raise:rank=1:step=3"] if ending == "worker-failure" else []),
        "-m",
        "stalwart",
        "train",
        "--config",
        "configs/debug.toml",
        f"--data.dir={stdlib_data}",
        "--data.seq_len=32",
        f"--train.steps={steps}",
        "--train.warmup_steps=2",
        "--train.log_every=1",
        f"--train.out_dir={out}",
        "--checkpoint.enabled=true",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        "--checkpoint.persist_every_steps=2",
    ]
    env = {**os.environ, "STALWART_CHAOS_DIR": str(tmp_path / "chaos")}
    with open(log, "wb") as sink:
        agent = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    watch = ProcessWatch(agent.pid, [node_id, str(run_dir), str(out)])
    try:
        with watch:
            if ending in ("ctrl-c", "agent-sigkill"):
                _wait_for(lambda: _steps_logged(out) >= 3, 180, "three training steps", agent, log)
                agent.send_signal(signal.SIGINT if ending == "ctrl-c" else signal.SIGKILL)
            code = agent.wait(180)
            deadline = time.monotonic() + GONE_WITHIN_S
            while watch.alive() and time.monotonic() < deadline:
                watch.scan()  # a process started at the very end is recorded too
                time.sleep(0.2)
        text = log.read_text()
        assert {
            "success": code == 0,
            "worker-failure": code == 1,
            "ctrl-c": code != 0,
            "agent-sigkill": code == -signal.SIGKILL,
        }[ending], (code, text[-3000:])
        cmdlines = list(watch.seen.values())
        assert any("stalwart.checkpoint" in c and "--parent" in c for c in cmdlines), (
            f"the agent started no keeper: {cmdlines}"
        )
        workers = [
            c
            for c in cmdlines
            if "zygote_client" in c or "die_with_agent" in c or ("stalwart train" in c and "stalwart run" not in c)
        ]
        assert len(workers) >= 2, cmdlines  # the two workers' processes (warm: their stand-ins) were seen
        assert watch.alive() == {}, f"left running {GONE_WITHIN_S} s after the agent: {watch.alive()}"
        if ending == "success":  # the keeper committed the last step and removed the snapshots
            assert Storage(str(tmp_path / "ckpt")).latest() == 4, text[-2000:]
            assert not list(user_dir("/dev/shm").glob(f"*-{node_id}"))
    finally:
        for pid in watch.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for left in user_dir("/dev/shm").glob(f"*-{node_id}"):
            shutil.rmtree(left, ignore_errors=True)
