"""Policies of the GPU-sharing simulator (``sharing_sim``). Each places waiting jobs every round and says
what throughput the two jobs of a shared GPU get.

- ``exclusive``: no sharing; production jobs first (they preempt opportunistic ones), then FIFO.
- ``gandiva`` (OSDI'18): no job classes; FIFO onto free GPUs, else greedy packing onto the running job
  (with enough GPUs, no partner) whose GPUs are least busy. A pack runs concurrently when that measured
  better than time-slicing (Gandiva's introspection: it tries and unpacks), else it is time-sliced
  half and half. Nothing protects a production job.
- ``antman`` (OSDI'20): production jobs are guaranteed (exclusive, preempting opportunistic ones);
  opportunistic jobs take free GPUs, else first fit onto a production job's GPUs, where they only use
  what the guaranteed job leaves: the guest is throttled to the largest duty cycle that keeps the host
  within the bound (measured, so the truth).
- ``muxflow`` (2023): as antman for production and free GPUs, but guests are chosen by maximum-weight
  bipartite matching (``scipy.optimize.linear_sum_assignment``) between production jobs and waiting
  opportunistic ones, weight = the guest's modelled throughput (GPU units) at the duty cycle the model
  says keeps the host within the bound (the host's loss within the bound is allowed, so not counted);
  the runtime guard still enforces the bound with the true interference.
- ``stalwart`` (issue 29 item 3): muxflow's matching, but a pair is made only where the model says it
  pays for the cluster: the guest's modelled gain minus the host's modelled loss (GPU units) is
  positive, the guest keeps ≥ ``MIN_GUEST_TPUT``, and the net gain over the pair's expected life beats
  a restart's worth of work; and a guest moves to free GPUs as soon as some are free.
A duty cycle d scales the pair's interference: host 1 - d (1 - p_host), guest d p_guest.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from stalwart.sched.interference import InterferenceModel
from stalwart.sched.sharing_sim import Cluster, Job, Truth

POLICIES = ("exclusive", "gandiva", "antman", "muxflow", "stalwart")
MATCH_WINDOW = 256  # waiting opportunistic jobs offered to the matching per round (FIFO head)
MIN_GUEST_TPUT = 0.25


class Policy(Protocol):
    def schedule(self, c: Cluster) -> None: ...
    def rates(self, host: Job, guest: Job) -> tuple[float, float]: ...


def make_policy(name: str, *, model: InterferenceModel, truth: Truth, bound: float, restart_cost_s: float) -> Policy:
    classes = {"exclusive": Exclusive, "gandiva": Gandiva, "antman": AntMan, "muxflow": MuxFlow, "stalwart": Stalwart}
    if name not in classes:
        raise ValueError(f"unknown sharing policy {name!r}; choose from {', '.join(POLICIES)}")
    return classes[name](model, truth, bound, restart_cost_s)


def duty_cycle(p_host: float, bound: float) -> float:
    """The largest guest duty cycle that keeps the host's throughput ≥ 1 - bound."""
    return 1.0 if 1.0 - p_host <= bound else bound / (1.0 - p_host)


def throttled(p_host: float, p_guest: float, bound: float) -> tuple[float, float]:
    d = duty_cycle(p_host, bound)
    return 1.0 - d * (1.0 - p_host), d * p_guest


class Exclusive:
    """Production first, no sharing. The base of the production-aware policies."""

    def __init__(self, model: InterferenceModel, truth: Truth, bound: float, restart_cost_s: float) -> None:
        self.model, self.truth, self.bound, self.restart_cost_s = model, truth, bound, restart_cost_s

    def schedule(self, c: Cluster) -> None:
        for job in [j for j in c.waiting if j.spec.production]:
            if c.make_room(job):
                c.run_exclusive(job)
        self.before_free(c)
        for job in [j for j in c.waiting if not j.spec.production]:
            if job.spec.gpus <= c.free:
                c.run_exclusive(job)
        self.share(c)

    def before_free(self, c: Cluster) -> None:
        """What to do with free GPUs before waiting opportunistic jobs take them (nothing here)."""

    def share(self, c: Cluster) -> None:
        """Place waiting opportunistic jobs as guests (none here)."""

    def rates(self, host: Job, guest: Job) -> tuple[float, float]:
        p_host, p_guest = self.truth.pair(host.features, guest.features)
        return throttled(p_host, p_guest, self.bound)


class AntMan(Exclusive):
    def share(self, c: Cluster) -> None:
        hosts = sorted(c.hosts(), key=lambda h: h.started_at)
        for job in [j for j in c.waiting if not j.spec.production]:
            host = next((h for h in hosts if h.spec.gpus >= job.spec.gpus), None)
            if host is not None:
                hosts.remove(host)
                c.attach(host, job)


class MuxFlow(Exclusive):
    def gain(self, host: Job, guest: Job) -> float:
        """Matching weight: the guest's modelled throughput in GPU units (-1: it does not fit)."""
        if guest.spec.gpus > host.spec.gpus:
            return -1.0
        return guest.spec.gpus * throttled(*self.model.pair(host.features, guest.features), self.bound)[1]

    def pays(self, host: Job, guest: Job, gain: float) -> bool:
        return gain > 1e-9

    def share(self, c: Cluster) -> None:
        from scipy.optimize import linear_sum_assignment

        hosts = c.hosts()
        guests = [j for j in c.waiting if not j.spec.production][:MATCH_WINDOW]
        if not hosts or not guests:
            return
        weights = np.array([[self.gain(h, g) for g in guests] for h in hosts])
        rows, cols = linear_sum_assignment(weights, maximize=True)
        for r, k in zip(rows, cols):
            if self.pays(hosts[r], guests[k], weights[r, k]):
                c.attach(hosts[r], guests[k])


class Stalwart(MuxFlow):
    def before_free(self, c: Cluster) -> None:
        for guest in sorted((j for j in c.running if j.mode == "guest"), key=lambda j: j.spec.submit):
            if guest.spec.gpus <= c.free:
                c.promote(guest)  # GPUs of its own beat a share; it came before anyone still waiting

    def gain(self, host: Job, guest: Job) -> float:
        """Net modelled gain (GPU units): the guest's throughput less what the host loses."""
        if guest.spec.gpus > host.spec.gpus:
            return -1.0
        tp_host, tp_guest = throttled(*self.model.pair(host.features, guest.features), self.bound)
        return guest.spec.gpus * tp_guest - host.spec.gpus * (1.0 - tp_host)

    def pays(self, host: Job, guest: Job, gain: float) -> bool:
        tp_guest = throttled(*self.model.pair(host.features, guest.features), self.bound)[1]
        expected = min(host.left, guest.left / max(tp_guest, 1e-9))  # how long the pair would last
        return tp_guest >= MIN_GUEST_TPUT and gain * expected > 2 * self.restart_cost_s * guest.spec.gpus


class Gandiva(Exclusive):
    def schedule(self, c: Cluster) -> None:
        for job in list(c.waiting):
            if job.spec.gpus <= c.free:
                c.run_exclusive(job)
                continue
            hosts = [h for h in c.running if h.mode == "excl" and h.guest is None and h.spec.gpus >= job.spec.gpus]
            if hosts:
                c.attach(min(hosts, key=lambda h: (h.spec.busy, h.started_at)), job)

    def rates(self, host: Job, guest: Job) -> tuple[float, float]:
        p_host, p_guest = self.truth.pair(host.features, guest.features)
        return (p_host, p_guest) if p_host + p_guest > 1.0 else (0.5, 0.5)
