"""Preemption without Slurm: SIGUSR1 to `stalwart run` persists the agreed in-memory snapshot, journals a
``preempted`` incident and exits 75; the same command then resumes to weights bitwise equal to an
uninterrupted run (model and optimizer)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stalwart.launch.journal import Journal
from stalwart.launch.preempt import EXIT_PREEMPTED

from .hung import reaped

pytestmark = pytest.mark.e2e
STEPS = 16


# Paced, so steps are left after the notice's wait under any load; rank 1's copy of step 6 is slowed,
# as load once did. Rank 0's copy of step 8 stalls (once: a requeued run goes on), so at the notice rank 1
# holds a step that rank 0 lacks and the agreed step is older than rank 1's newest: as once under load,
# when rank 1's node waited for its own newest step until Slurm killed its agent.
PACE = (
    "--chaos",
    "slow:seconds=0.1;delay:at=copy:rank=1:step=6:seconds=1;delay:at=copy:rank=0:step=8:seconds=30:once=1",
)
# Rank 0 has logged step 8 ⇒ rank 1 took part in step 8's all-reduce ⇒ it had started its snapshot of
# step 7, which first waits until the snapshot of step 6 is published (memory_every=1, pinned below).
# A notice after that saves step 6 or later. (Waiting for 6 logged steps once saved 5: rank 1's copy
# of 6 was still running.)
HELD_6 = 8


def command(tmp_path: Path, data: Path, run: str, *run_flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(tmp_path / run),
        "--summary-json",
        str(tmp_path / f"{run}.json"),
        *run_flags,
        "-m",
        "stalwart",
        "train",
        "--config",
        "configs/debug.toml",
        f"--data.dir={data}",
        "--data.seq_len=64",
        f"--train.steps={STEPS}",
        "--train.warmup_steps=2",
        f"--train.out_dir={tmp_path / 'out'}",
        "--checkpoint.enabled=true",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        "--checkpoint.persist_every_steps=1000",  # only the preemption persists
        "--checkpoint.memory_every=1",  # a snapshot every step: HELD_6's reasoning
        "--train.threads=1",  # test_slurm's agents run one worker each: it would take both cores
    ]


def steps_logged(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def notice_after(proc: subprocess.Popen, ready: Callable[[], bool], poll_s: float) -> None:
    """SIGUSR1 (the notice) to the run once ``ready()``; it ends preempted."""
    with reaped(proc):
        deadline = time.monotonic() + 240
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(poll_s)
        assert proc.poll() is None, "the run ended before the notice"
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err.decode()[-4000:]


def test_preempt_persists_and_the_rerun_resumes_bitwise(stdlib_data, preempt_reference, tmp_path):
    run1 = command(tmp_path, stdlib_data, "run1", *PACE)
    proc = subprocess.Popen(run1, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    notice_after(proc, lambda: steps_logged(tmp_path / "out") >= HELD_6, poll_s=0.2)

    notice = json.loads((tmp_path / "run1.json").read_text())["preempted"]
    step = notice["save"]["step"]
    assert notice["signal"] == "SIGUSR1" and 6 <= step < STEPS, notice
    assert (tmp_path / "ckpt" / f"step-{step:08d}").is_dir(), "the agreed snapshot was committed"
    [row] = Journal(tmp_path / "run1" / "journal.sqlite").incidents()
    assert row["kind"] == "preempted" and row["details"]["save"]["step"] == step

    again = subprocess.run(command(tmp_path, stdlib_data, "run2"), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["checkpoint"]["restored_from"] == "storage" and summary["checkpoint"]["restore_step"] == step
    assert summary["final_hash"] == preempt_reference["final_hash"]
    assert summary["optim_hash"] == preempt_reference["optim_hash"]
    assert summary["samples_consumed"] == preempt_reference["samples_consumed"]


def test_a_notice_during_a_snapshot_copy_lets_the_copy_finish_and_saves_that_step(stdlib_data, tmp_path):
    """Both ranks' copies of step 8 take 2 s; the notice comes once both are under way (their chaos
    delays have fired: one marker each), so the agent's SIGTERM finds them there. The workers finish
    them (bounded) before they die of it, and the preemption saves step 8 (before, SIGTERM's default cut
    them and it saved step 7)."""
    slow_copies = ";".join(f"delay:at=copy:step=8:rank={r}:seconds=2:once=1" for r in (0, 1))
    run1 = command(tmp_path, stdlib_data, "run1", "--chaos", f"slow:seconds=0.1;{slow_copies}")
    proc = subprocess.Popen(run1, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    fired = tmp_path / "run1" / "chaos" / "fired"  # `stalwart run`'s marker directory (launch.run)
    notice_after(proc, lambda: len(list(fired.glob("*.fired"))) == 2, poll_s=0.02)
    notice = json.loads((tmp_path / "run1.json").read_text())["preempted"]
    step = notice["save"]["step"]  # 9 only if the stop came after step 9's copy (the box stalled > 2 s)
    assert step >= 8, notice
    assert (tmp_path / "ckpt" / f"step-{step:08d}").is_dir()
