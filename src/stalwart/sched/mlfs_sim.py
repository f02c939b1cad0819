"""``stalwart sim pollux --policies hypersched,mlfs``: the learned policy and its greedy baseline on whole
Pollux workloads, as ``SimResult`` rows like the other policies'. Both run each job at the workload's
tuned batch (as Optimus and Tiresias do; Pollux also adapts the batch) and choose GPU counts on the
``mlfs_env.RUNGS`` ladder. ``mlfs`` needs a trained network (``mlfs_train.train`` or ``load_policy``)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from torch import nn

from stalwart.sched.hypersched import HyperSched
from stalwart.sched.mlfs_env import Window, load_jobs, run_episode
from stalwart.sched.mlfs_policy import Greedy, torch_threads
from stalwart.sched.mlfs_train import TRAIN_WORKLOADS, TrainConfig, plot_curve, train
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


def prepare(args: Any, policies: list[str], kwargs: dict[str, Any], bar: Any) -> dict[str, Any]:
    """For ``stalwart sim``: train ``mlfs`` when it is asked for (``--episodes``, ``--budget-s``,
    ``--checkpoint``; ``--seed`` seeds it; a line on the progress bar), draw its learning curve beside
    ``--plot`` (``<stem>-mlfs-curve.png``), and return the simulate function and the training report."""
    if "mlfs" not in policies:
        return {"simulate": simulate}
    if args.episodes < 1:
        raise ValueError(f"--episodes must be ≥ 1, got {args.episodes}")
    root = kwargs.get("data_root", DEFAULT_ROOT)
    config = TrainConfig(
        seed=args.seed,
        episodes=args.episodes,
        imitation_episodes=min(TrainConfig.imitation_episodes, args.episodes // 2),
        restart_cost_s=kwargs.get("restart_cost_s", 30.0),
    )
    task = bar.add_task("training mlfs", total=config.episodes)
    result = train(
        config,
        checkpoint=args.checkpoint,
        budget_s=args.budget_s,
        progress=lambda done, total, _: bar.update(task, completed=done),
        data_root=root,
    )
    bar.remove_task(task)
    if args.plot:
        plot_curve(result.curve, Path(args.plot).with_name(Path(args.plot).stem + "-mlfs-curve.png"))
    report = result.report() | {"train_workloads": list(config.train_workloads), "window_jobs": config.window_jobs}
    return {"simulate": partial(simulate, net=result.net, trained_on=config.train_workloads), "report": report}
