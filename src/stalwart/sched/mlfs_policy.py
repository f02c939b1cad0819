"""The learned policy of ``mlfs`` (after MLFS, Wang et al.: a policy network over jobs' performance-model
features that adds or removes GPUs per job). One small MLP, shared by all jobs, scores each job's GPU
count on the ladder ``mlfs_env.RUNGS`` from ``mlfs_env.features``; counts the cluster cannot hold are
masked and ``mlfs_env.grant`` trims the rest to capacity, so no output over-allocates.

Choosers (``mlfs_env.Chooser``): ``Greedy`` takes each job's most likely count (evaluation); ``Sampler``
draws from the policy with its own generator and records what training needs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from stalwart.sched.mlfs_env import N_FEATURES, RUNGS, features
from stalwart.sched.pollux_sim import SimJob

HIDDEN = 32


def make_net(seed: int) -> nn.Module:
    """The policy network, initialised from ``seed`` alone (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, len(RUNGS)),
        )


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch on ``n`` CPU threads inside the block: one thread is bitwise reproducible, and a tiny MLP on
    a shared machine runs far faster without a thread pool that spins waiting for busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def masked_logits(net: nn.Module, feats: np.ndarray | torch.Tensor, mask: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Logits with the counts a job cannot take at −inf (rung 0, stopping, is always allowed)."""
    logits = net(torch.as_tensor(feats))
    return logits.masked_fill(~torch.as_tensor(mask), float("-inf"))


class Greedy:
    """Each job's most likely count under ``net`` (no gradient, no randomness)."""

    def __init__(self, net: nn.Module) -> None:
        self.net = net

    def __call__(self, now: float, jobs: list[SimJob], gpus: int) -> list[int]:
        feats, mask = features(jobs, now, gpus)
        with torch.no_grad():
            best = masked_logits(self.net, feats, mask).argmax(dim=1)
        return [RUNGS[int(k)] for k in best]


@dataclass
class Decision:
    """What one interval's sampled decision needs for the update: inputs, the sampled rungs, the teacher's
    rungs (the greedy baseline's wish, for the imitation anchor), and when it was taken."""

    now: float
    feats: np.ndarray
    mask: np.ndarray
    actions: np.ndarray
    teacher: np.ndarray


@dataclass
class Sampler:
    """Draws each job's count from the policy (``generator`` seeds it) and records the decisions;
    ``teacher`` is asked too, for its labels. ``follow_teacher`` runs the teacher's counts instead
    (the imitation phase), still recording the policy's inputs."""

    net: nn.Module
    teacher: object
    generator: torch.Generator
    follow_teacher: bool = False
    decisions: list[Decision] = field(default_factory=list)

    def __call__(self, now: float, jobs: list[SimJob], gpus: int) -> list[int]:
        from stalwart.sched.mlfs_env import rung_of

        feats, mask = features(jobs, now, gpus)
        wished = self.teacher(now, jobs, gpus)  # type: ignore[operator]
        teacher = np.array([rung_of(c) for c in wished])
        mask[np.arange(len(jobs)), teacher] = True  # the teacher's count is always a valid label
        if self.follow_teacher:
            actions = teacher
        else:
            with torch.no_grad():
                probs = torch.softmax(masked_logits(self.net, feats, mask), dim=1)
            actions = torch.multinomial(probs, 1, generator=self.generator)[:, 0].numpy()
        self.decisions.append(Decision(now, feats, mask, actions, teacher))
        return [RUNGS[int(k)] for k in actions]
