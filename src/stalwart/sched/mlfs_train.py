"""Training the ``mlfs`` policy in the simulator: deterministic under a seed, bounded in time,
checkpointed, with its learning curve and the cost its exploration would have had online.

- Episodes are windows of ``window_jobs`` consecutive jobs (stride half a window) of the *training*
  workloads (default Pollux workloads 1–4; 5–8, generated with other seeds, are held out for
  evaluation). Episode i's window and its action samples come from a generator seeded by (seed, i)
  alone, so a resumed run draws exactly what an uninterrupted one would.
- The first ``imitation_episodes`` run the greedy ``hypersched`` and fit the network to its choices
  (MLFS starts from its heuristic's decisions too); then REINFORCE: each interval's decision is credited
  with the job-hours saved from then on relative to the greedy policy on the same window
  (return-to-go minus the greedy's at the same time, so the baseline is the heuristic, per state), plus
  an imitation anchor (``anchor`` × cross-entropy to the greedy's choice) against drifting.
- Torch runs on the CPU with ``threads`` threads (1 by default: bitwise reproducible); ``budget_s``
  stops training after the episode that crosses it (so a budget-cut run is reproducible only in the
  episodes it did; the checkpoint says how many).
- Exploration cost: every learning episode is a run of a not-yet-good policy on real jobs if trained
  online; its JCT and GPU-hours beyond the greedy policy's on the same window are summed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stalwart.sched.hypersched import HyperSched
from stalwart.sched.mlfs_env import Episode, Window, load_jobs, run_episode
from stalwart.sched.mlfs_policy import Decision, Sampler, make_net, masked_logits, torch_threads
from stalwart.sched.pollux_workload import DEFAULT_ROOT, load_workload

CHECKPOINT_VERSION = 1
TRAIN_WORKLOADS = (1, 2, 3, 4)
EVAL_WORKLOADS = (5, 6, 7, 8)


@dataclass(frozen=True)
class TrainConfig:
    """What a training run is; everything that changes the weights is here (and in the checkpoint)."""

    seed: int = 0
    episodes: int = 80
    imitation_episodes: int = 8
    imitation_steps: int = 40
    window_jobs: int = 40
    train_workloads: tuple[int, ...] = TRAIN_WORKLOADS
    lr: float = 3e-3
    anchor: float = 0.1
    entropy: float = 0.01
    gpus: int = 64
    interval_s: float = 60.0
    restart_cost_s: float = 30.0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.episodes < 1 or self.imitation_episodes < 0 or self.window_jobs < 2 or self.threads < 1:
            raise ValueError(
                f"need episodes ≥ 1, imitation_episodes ≥ 0, window_jobs ≥ 2, threads ≥ 1; got {self.episodes}, "
                f"{self.imitation_episodes}, {self.window_jobs}, {self.threads}"
            )
        if not self.train_workloads or any(w not in range(1, 9) for w in self.train_workloads):
            raise ValueError(f"train_workloads are Pollux workload numbers 1-8, got {self.train_workloads}")

    def windows(self, root: Path = DEFAULT_ROOT) -> list[Window]:
        """Every training window: ``window_jobs`` jobs, stride half of that, per training workload."""
        out = []
        stride = max(1, self.window_jobs // 2)
        for w in self.train_workloads:
            n = len(load_workload(w, root))
            out += [Window(w, f, self.window_jobs) for f in range(0, max(1, n - self.window_jobs + 1), stride)]
        return out


# progress(episodes done, episodes total, last curve point)
TrainProgress = Callable[[int, int, dict[str, Any]], None]


@dataclass
class TrainResult:
    net: nn.Module
    curve: list[dict[str, Any]]
    episodes_done: int
    stopped_by_budget: bool
    wall_s: float

    def report(self) -> dict[str, Any]:
        """The learning curve and the cost of exploration (learning episodes vs greedy on the same jobs)."""
        learning = [c for c in self.curve if c["phase"] == "rl"]
        jct, greedy = sum(c["jct_h"] for c in learning), sum(c["greedy_jct_h"] for c in learning)
        gpu, greedy_gpu = sum(c["gpu_h"] for c in learning), sum(c["greedy_gpu_h"] for c in learning)
        return {
            "episodes": self.episodes_done,
            "stopped_by_budget": self.stopped_by_budget,
            "wall_s": round(self.wall_s, 2),
            "curve": self.curve,
            "exploration_cost": {
                "learning_episodes": len(learning),
                "extra_jct_job_hours": round(jct - greedy, 3),
                "extra_jct_ratio": round(jct / greedy - 1, 4) if greedy else None,
                "extra_gpu_hours": round(gpu - greedy_gpu, 3),
                "extra_gpu_ratio": round(gpu / greedy_gpu - 1, 4) if greedy_gpu else None,
            },
        }


def train(
    config: TrainConfig,
    *,
    checkpoint: Path | None = None,
    budget_s: float | None = None,
    checkpoint_every: int = 5,
    progress: TrainProgress | None = None,
    data_root: Path = DEFAULT_ROOT,
) -> TrainResult:
    """Train (or resume from ``checkpoint`` when it exists) up to ``config.episodes`` episodes."""
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"--budget-s must be > 0, got {budget_s}")
    windows = config.windows(data_root)
    net = make_net(config.seed)
    opt = torch.optim.Adam(net.parameters(), lr=config.lr)
    curve: list[dict[str, Any]] = []
    if checkpoint is not None and Path(checkpoint).exists():
        curve = _load(Path(checkpoint), config, net, opt)
    greedy: dict[Window, Episode] = {}  # the baseline per window: recomputed, deterministic
    started, stopped = time.perf_counter(), False
    with torch_threads(config.threads):
        for episode in range(len(curve), config.episodes):
            gen = torch.Generator().manual_seed(config.seed * 1_000_003 + episode)
            window = windows[int(torch.randint(len(windows), (1,), generator=gen))]
            if window not in greedy:
                greedy[window] = _run(window, HyperSched(config.restart_cost_s), config, data_root)
            imitation = episode < config.imitation_episodes
            sampler = Sampler(net, HyperSched(config.restart_cost_s), gen, follow_teacher=imitation)
            ep = _run(window, sampler, config, data_root)
            if imitation:
                _imitate(net, opt, sampler.decisions, config)
            else:
                _reinforce(net, opt, sampler.decisions, ep, greedy[window], config)
            base = greedy[window]
            curve.append(
                {
                    "episode": episode,
                    "phase": "imitation" if imitation else "rl",
                    "window": [window.workload, window.first],
                    "jct_h": round(ep.jct_hours, 4),
                    "greedy_jct_h": round(base.jct_hours, 4),
                    "ratio": round(ep.jct_hours / base.jct_hours, 4),
                    "gpu_h": round(ep.gpu_hours, 4),
                    "greedy_gpu_h": round(base.gpu_hours, 4),
                }
            )
            if progress is not None:
                progress(episode + 1, config.episodes, curve[-1])
            last = episode + 1 == config.episodes
            stopped = not last and budget_s is not None and time.perf_counter() - started > budget_s
            if checkpoint is not None and (last or stopped or (episode + 1) % checkpoint_every == 0):
                _save(Path(checkpoint), config, net, opt, curve)
            if stopped:
                break
    return TrainResult(net, curve, len(curve), stopped, time.perf_counter() - started)


def _run(window: Window, chooser: Any, config: TrainConfig, root: Path) -> Episode:
    jobs = load_jobs(window, root)
    return run_episode(
        jobs, chooser, gpus=config.gpus, interval_s=config.interval_s, restart_cost_s=config.restart_cost_s
    )


def _stack(decisions: list[Decision]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    feats = torch.as_tensor(np.concatenate([d.feats for d in decisions]))
    mask = torch.as_tensor(np.concatenate([d.mask for d in decisions]))
    actions = torch.as_tensor(np.concatenate([d.actions for d in decisions]), dtype=torch.long)
    teacher = torch.as_tensor(np.concatenate([d.teacher for d in decisions]), dtype=torch.long)
    return feats, mask, actions, teacher


def _imitate(net: nn.Module, opt: torch.optim.Optimizer, decisions: list[Decision], config: TrainConfig) -> None:
    """Fit the network to the greedy policy's choices in this episode (full-batch cross-entropy)."""
    if not decisions:
        return
    feats, mask, _, teacher = _stack(decisions)
    for _ in range(config.imitation_steps):
        loss = nn.functional.cross_entropy(masked_logits(net, feats, mask), teacher)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _reinforce(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    decisions: list[Decision],
    ep: Episode,
    base: Episode,
    config: TrainConfig,
) -> None:
    """One REINFORCE step: each decision's advantage is the job-hours it went on to save vs the greedy
    policy from the same moment on, scaled by the episode's spread; all of a decision's job actions
    share it (one joint action per interval)."""
    if not decisions:
        return
    ours = np.cumsum(np.asarray(ep.costs)[::-1])[::-1]  # cost from interval k on
    theirs = np.cumsum(np.asarray(base.costs)[::-1])[::-1]
    adv = []
    for d in decisions:
        k = round(d.now / config.interval_s)
        adv.append((theirs[k] if k < len(theirs) else 0.0) - (ours[k] if k < len(ours) else 0.0))
    adv_t = torch.tensor(adv, dtype=torch.float32)
    adv_t = adv_t / (adv_t.abs().mean() + 1e-6)
    rows = torch.as_tensor(np.concatenate([np.full(len(d.actions), i) for i, d in enumerate(decisions)]))
    feats, mask, actions, teacher = _stack(decisions)
    logp = torch.log_softmax(masked_logits(net, feats, mask), dim=1)
    chosen = logp.gather(1, actions[:, None])[:, 0]
    probs = logp.exp()
    entropy = -(probs * logp.masked_fill(~mask, 0.0)).sum(dim=1).mean()
    policy = -(adv_t[rows] * chosen).sum() / len(decisions)
    loss = policy + config.anchor * nn.functional.nll_loss(logp, teacher) - config.entropy * entropy
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()


def _config_dict(config: TrainConfig) -> dict[str, Any]:
    out = asdict(config)
    out["train_workloads"] = list(config.train_workloads)
    out.pop("episodes")  # a resume may train further
    return out


def _save(path: Path, config: TrainConfig, net: nn.Module, opt: torch.optim.Optimizer, curve: list) -> None:
    """Atomically: weights, optimizer state, curve (= episodes done), the config they belong to."""
    state = {
        "version": CHECKPOINT_VERSION,
        "config": _config_dict(config),
        "weights": net.state_dict(),
        "optim": opt.state_dict(),
        "curve": curve,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load(path: Path, config: TrainConfig, net: nn.Module, opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    state = torch.load(path, weights_only=True)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {state.get('version')}, this stalwart reads {CHECKPOINT_VERSION}")
    if state["config"] != _config_dict(config):
        diff = {k: (v, state["config"].get(k)) for k, v in _config_dict(config).items() if state["config"].get(k) != v}
        raise ValueError(f"{path} was trained with other settings (now, checkpoint): {diff}; use another --checkpoint")
    net.load_state_dict(state["weights"])
    opt.load_state_dict(state["optim"])
    return list(state["curve"])


def load_policy(path: Path) -> nn.Module:
    """The trained network in ``path`` (for evaluation without the training settings)."""
    state = torch.load(path, weights_only=True)
    net = make_net(0)
    net.load_state_dict(state["weights"])
    return net


def plot_curve(curve: list[dict[str, Any]], path: Path) -> None:
    """JCT of each training episode relative to the greedy policy on the same window, and its moving
    average: below 1 the learned policy is ahead."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'stalwart[plot]'") from None
    x = [c["episode"] for c in curve]
    y = [c["ratio"] for c in curve]
    avg = [float(np.mean(y[max(0, i - 9) : i + 1])) for i in range(len(y))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(x, y, s=8, alpha=0.5, label="episode")
    ax.plot(x, avg, label="moving average (10)")
    ax.axhline(1.0, color="grey", linestyle="--", label="greedy (hypersched)")
    imitation = [c["episode"] for c in curve if c["phase"] == "imitation"]
    if imitation:
        ax.axvspan(-0.5, max(imitation) + 0.5, color="orange", alpha=0.15, label="imitation phase")
    ax.set_xlabel("training episode")
    ax.set_ylabel("total JCT / greedy's, same window")
    ax.set_title("mlfs learning curve")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
