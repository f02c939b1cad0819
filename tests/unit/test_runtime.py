"""The worker ↔ agent contract reads every variable once, typed, and only when asked."""

from __future__ import annotations

import pytest

from stalwart import runtime


def test_defaults_without_a_launcher() -> None:
    env = runtime.WorkerEnv.from_environ({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert not env.launched and not env.under_agent and not env.parent_reports


def test_reads_torchrun_and_stalwart_variables() -> None:
    env = runtime.WorkerEnv.from_environ({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        runtime.ENV_PROGRESS_DIR: "/p", runtime.ENV_JOB_ID: "j", runtime.ENV_NODE_ID: "n",
        runtime.ENV_CHAOS: "kill:rank=1:step=2", runtime.ENV_PARENT_REPORTS: "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.group_rank) == (3, 4, 1, 2, 1)
    assert env.launched and env.under_agent and env.parent_reports
    assert (env.progress_dir, env.job_id, env.node_id, env.chaos) == ("/p", "j", "n", "kill:rank=1:step=2")


def test_bad_integer_names_the_variable() -> None:
    with pytest.raises(ValueError, match="RANK='x'"):
        runtime.WorkerEnv.from_environ({"RANK": "x", "WORLD_SIZE": "2"})


def test_read_lazily_once_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.reset()
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert runtime.worker_env().rank == 5
    monkeypatch.setenv("RANK", "6")
    assert runtime.worker_env().rank == 5  # read once: the contract does not change under a running worker
    runtime.reset()
    assert runtime.worker_env().rank == 6
    runtime.reset()
