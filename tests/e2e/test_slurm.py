"""`srun stalwart run` on a real one-host Slurm (tests/e2e/slurm_cluster.py): two tasks, one agent each,
take their world, master and rendezvous from Slurm's environment. A preemption notice
(`scancel --signal=USR1`) persists, requeues the job, and the requeued job finishes with weights bitwise
equal to an uninterrupted run; a worker killed inside the allocation heals there."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from stalwart.launch.journal import Journal
from stalwart.launch.preempt import EXIT_PREEMPTED
from stalwart.utils.ports import free_port

from .slurm_cluster import SlurmCluster, missing
from .test_preempt import HELD_6, PACE, STEPS, command, steps_logged

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield c
    finally:
        c.stop()


def port_pair() -> int:
    """A free port whose successor is free too: the master's and its rendezvous store's."""
    return free_port(count=2)


def submit(cluster: SlurmCluster, work: Path, data: Path, *run_flags: str, tasks: int = 2) -> str:
    """sbatch a job of ``tasks`` agents (2 ranks in all): `srun stalwart run -m stalwart train`, without
    rendezvous or master flags."""
    train = command(work, data, "run")
    train = train[train.index("-m", 4) :]  # `-m stalwart train ...`: the training half of the command line
    summary = f"{work}/summary.$SLURM_PROCID.${{SLURM_RESTART_COUNT:-0}}.json"
    agent = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--nproc-per-node",
        str(2 // tasks),
        "--run-dir",
        str(work / "run"),
    ]
    flags = " ".join(f'"{f}"' for f in run_flags)  # inside the single-quoted `bash -c`: a chaos `;` stays
    script = work / "job.sh"
    script.write_text(
        f"#!/bin/bash\ncd {REPO}\n"
        f"srun --kill-on-bad-exit=0 bash -c 'exec {' '.join(agent)} --summary-json {summary} "
        f"{flags} {' '.join(train)}'\n"
    )
    env = {"STALWART_SLURM_PORT": str(port_pair())}
    out = cluster.run(
        "sbatch",
        "--parsable",
        f"-n{tasks}",
        f"-c{2 // tasks}",
        "--requeue",
        "--open-mode=append",
        "-o",
        str(work / "job.out"),
        str(script),
        env=env,
    )
    return out.stdout.strip().split(";")[0]


def wait_done(cluster: SlurmCluster, job: str, work: Path, timeout_s: float = 240) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while (info := cluster.job(job))["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, (
            f"job {job} still {info['JobState']}: {(work / 'job.out').read_text()[-3000:]}"
        )
        time.sleep(0.5)
    assert info["JobState"] == "COMPLETED", f"{info}\n{(work / 'job.out').read_text()[-4000:]}\n{cluster.logs()}"
    return info


def summaries(work: Path) -> dict[tuple[int, int], dict]:
    """(task, restart count) → that agent's run summary."""
    out = {}
    for f in work.glob("summary.*.json"):
        _, task, restart, _ = f.name.split(".")
        out[int(task), int(restart)] = json.loads(f.read_text())
    return out


def assert_same_weights(work: Path, reference: dict) -> dict:
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert summary["final_hash"] == reference["final_hash"]
    assert summary["optim_hash"] == reference["optim_hash"]
    assert summary["samples_consumed"] == reference["samples_consumed"]
    return summary


def test_preempted_job_requeues_and_ends_bitwise_equal(cluster, stdlib_data, preempt_reference, tmp_path):
    job = submit(cluster, tmp_path, stdlib_data, "--requeue-on-preempt", *PACE)
    deadline = time.monotonic() + 180
    while steps_logged(tmp_path / "out") < HELD_6:
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), (
            tmp_path / "job.out"
        ).read_text()[-3000:]
        time.sleep(0.2)
    cluster.run("scancel", "--signal=USR1", job)
    info = wait_done(cluster, job, tmp_path)
    assert info["Restarts"] == "1", info

    runs = summaries(tmp_path)
    first = runs[0, 0]["preempted"]
    assert runs[0, 0]["exit_code"] == EXIT_PREEMPTED and first["requeue"]["requeued"], runs[0, 0]
    step = first["save"]["step"]
    assert 6 <= step < STEPS and (tmp_path / "ckpt" / f"step-{step:08d}").is_dir(), first
    assert (1, 0) in runs, "task 1 ended before its summary:\n" + (tmp_path / "job.out").read_text()[-4000:]
    assert runs[1, 0]["exit_code"] == EXIT_PREEMPTED, "both agents took the notice"
    assert runs[0, 1]["exit_code"] == 0 and runs[1, 1]["exit_code"] == 0
    print(
        f"signal→workers stopped {first['workers_stopped'] - first['received']:.2f} s, →persisted "
        f"{first['persisted_at'] - first['received']:.2f} s, →agent exit {first['exit'] - first['received']:.2f} s"
    )
    kinds = [row["kind"] for row in Journal(tmp_path / "run" / "journal.sqlite").incidents()]
    assert kinds.count("preempted") == 2, kinds

    summary = assert_same_weights(tmp_path, preempt_reference)
    assert summary["checkpoint"]["restored_from"] == "storage" and summary["checkpoint"]["restore_step"] == step
    remove_kept(tmp_path / "job.out")


def remove_kept(console: Path) -> None:
    """A preempted node whose newest snapshot is newer than the committed step keeps it in /dev/shm for
    the requeue, says so with its expiry (checkpoint.keep_shm_s) and the requeued job's agents count it
    at their start; the test removes it (the suite fails on a finished job's directory left there)."""
    text = console.read_text()
    kept = re.findall(r"stalwart run: snapshots kept in (\S+) for the requeue until \S+ \S+", text)
    for path in kept:
        assert (Path(path) / "kept.json").is_file(), path
        shutil.rmtree(path)
    if kept:
        assert "stalwart run: stale snapshots in " in text.split(f"snapshots kept in {kept[-1]}")[1], text[-3000:]


def test_worker_killed_inside_srun_heals_in_the_allocation(cluster, stdlib_data, preempt_reference, tmp_path):
    """One task with both ranks (the single-task path: only the run id comes from Slurm)."""
    job = submit(cluster, tmp_path, stdlib_data, "--max-restarts", "2", "--chaos", "kill:rank=1:step=6", tasks=1)
    info = wait_done(cluster, job, tmp_path)
    assert info["Restarts"] == "0", "healed without leaving the allocation"
    runs = summaries(tmp_path)
    assert set(runs) == {(0, 0)}
    run = runs[0, 0]
    assert run["exit_code"] == 0 and run["restarts_used"] == 1, run
    assert [i["kind"] for i in run["incidents"]] == ["sigkill"], run["incidents"]
    assert (tmp_path / "run" / "journal.sqlite").exists() and (tmp_path / "summary.0.0.json").exists()
    summary = assert_same_weights(tmp_path, preempt_reference)
    assert summary["checkpoint"]["restored_from"] == "memory"
