"""``stalwart sim pollux --policies hypersched,mlfs``: the learned policy and its greedy baseline on whole
Pollux workloads, as ``SimResult`` rows like the other policies'. Both run each job at the workload's
tuned batch (as Optimus and Tiresias do; Pollux also adapts the batch) and choose GPU counts on the
``mlfs_env.RUNGS`` ladder. ``mlfs`` needs a trained network (``mlfs_train.train`` or ``load_policy``)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from stalwart.sched.hypersched import HyperSched
from stalwart.sched.mlfs_env import Window, load_jobs, run_episode
from stalwart.sched.mlfs_policy import Greedy, torch_threads
from stalwart.sched.mlfs_train import TRAIN_WORKLOADS
from stalwart.sched.pollux_workload import DEFAULT_ROOT
from stalwart.sched.sim_result import Progress, SimResult

POLICIES: tuple[str, ...] = ("hypersched", "mlfs")


def simulate(
    workload: int,
    policy: str,
    *,
    net: nn.Module | None = None,
    trained_on: tuple[int, ...] = TRAIN_WORKLOADS,
    gpus: int = 64,
    seed: int = 0,
    restart_cost_s: float = 30.0,
    interval_s: float = 60.0,
    progress: Progress | None = None,
    data_root: Path = DEFAULT_ROOT,
) -> SimResult:
    """Run ``policy`` over Pollux workload ``workload`` (1..8) on ``gpus`` GPUs until every job finishes;
    the row says whether the workload was one the network was trained on (``unseen``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if policy == "mlfs" and net is None:
        raise ValueError("the mlfs policy needs a trained network: train it first (stalwart sim trains it)")
    chooser = HyperSched(restart_cost_s) if policy == "hypersched" else Greedy(net)  # type: ignore[arg-type]
    jobs = load_jobs(Window(int(workload)), data_root)
    with torch_threads(1):
        ep = run_episode(
            jobs, chooser, gpus=gpus, interval_s=interval_s, restart_cost_s=restart_cost_s, progress=progress
        )
    extra = {"restart_cost_s": restart_cost_s, "interval_s": interval_s, "seed": seed}
    if policy == "mlfs":
        extra["unseen"] = int(workload) not in trained_on
    return SimResult(
        f"workload-{int(workload)}", policy, gpus, ep.outcomes, reallocations=ep.reallocations, extra=extra
    )
