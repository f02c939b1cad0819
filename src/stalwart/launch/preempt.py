"""Preemption: a notice (Slurm ``--signal=USR1@120``, Kubernetes' SIGTERM before the grace period ends)
becomes a persisted checkpoint and a clean, requeue-friendly exit.

The newest snapshot every rank agrees on is in shared memory already, so the agent only stops the
workers and persists it (the persist time, not a save), journals a ``preempted`` incident and exits
with ``EXIT_PREEMPTED``; with ``--requeue-on-preempt`` it asks Slurm to requeue the job first
(``scontrol requeue``), and the requeued job resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing import SignalException

if TYPE_CHECKING:
    from stalwart.launch.client import MasterClient

log = logging.getLogger("stalwart.preempt")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"; Kubernetes podFailurePolicy can ignore it
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"


class Preempted(SignalException):
    """Raised in the agent's main thread by the preemption signal. A TorchElastic ``SignalException``,
    so its ``run`` stops the workers (with SIGTERM, whatever the notice was) before it propagates."""

    def __init__(self, signum: int, received: float) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name}", signal.SIGTERM)
        self.signum, self.received = signum, received


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--preempt-signals",
        default=DEFAULT_SIGNALS,
        help="signals that mean preemption: the agent stops the workers, persists the newest snapshot all "
        f"ranks agree on, journals a 'preempted' incident and exits with code {EXIT_PREEMPTED} "
        f"(comma-separated, '' for none; default {DEFAULT_SIGNALS})",
    )
    group.add_argument(
        "--requeue-on-preempt",
        action="store_true",
        help="after persisting on preemption, requeue the Slurm job (scontrol requeue $SLURM_JOB_ID, from "
        "the first task only); the requeued job resumes from the persisted checkpoint",
    )


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    out = []
    for name in filter(None, (s.strip().upper() for s in spec.split(","))):
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            out.append(signal.Signals[name])
        except KeyError:
            raise ValueError(f"--preempt-signals: unknown signal {name!r} (e.g. SIGTERM,SIGUSR1)") from None
        if out[-1] in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ValueError(f"--preempt-signals: {name} cannot be a preemption notice")
    return tuple(out)


def torch_signals(torch_spec: str, preempt: tuple[signal.Signals, ...]) -> str:
    """TorchElastic's own signal list without ours (it would replace our handler at every start)."""
    names = {s.name for s in preempt}
    return ",".join(s for s in torch_spec.split(",") if s.strip() and s.strip() not in names)


@dataclass
class Preemption:
    """The agent's preemption handler: ``shield`` before starting helpers, ``arm`` around the agent."""

    signals: tuple[signal.Signals, ...]
    received: float | None = None
    signum: int = 0  # the notice received
    timeline: dict[str, Any] = field(default_factory=dict)

    def shield(self) -> None:
        """Ignore the notice in the processes started from now on (the keeper, the zygote): Slurm
        signals every process of the step, and a keeper killed by SIGUSR1 could not take part in the
        persist. An ignored signal stays ignored across exec. SIGTERM is left alone: it is how the agent
        stops them. Until ``arm`` the agent ignores the notice too."""
        for sig in self.signals:
            if sig != signal.SIGTERM:
                signal.signal(sig, signal.SIG_IGN)

    def arm(self) -> None:
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def disarm(self) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)  # a second notice during the persist must not cut it short

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received, self.signum = time.time(), signum
        self.disarm()
        raise Preempted(signum, self.received)

    def check_workers(self, exit_codes: list[int]) -> None:
        """Raise ``Preempted`` when a worker died of the notice itself: Slurm signals every process of
        the step, and a worker whose disposition is the default (a cold-started script) may die before
        the agent's own handler runs — that death is the preemption, not a fault to restart from."""
        died_of = [-code for code in exit_codes if -code in self.signals and -code != signal.SIGTERM]
        if died_of and self.received is None:
            self.received, self.signum = time.time(), died_of[0]
            self.disarm()
            raise Preempted(died_of[0], self.received)

    def missed(self) -> Preempted | None:
        """The notice, if it arrived but its exception was swallowed (raised inside a library's
        ``except Exception``, e.g. TorchElastic's log tailer while stopping workers)."""
        return Preempted(self.signum, self.received) if self.received is not None else None


def requeue(env: Mapping[str, str], timeout_s: float = 30.0) -> dict[str, Any]:
    """``scontrol requeue $SLURM_JOB_ID``: Slurm ends this allocation and queues the job again (same job
    id, ``SLURM_RESTART_COUNT`` + 1). Returns what happened, for the summary and the journal."""
    job_id = env.get("SLURM_JOB_ID")
    scontrol = shutil.which("scontrol")
    if not job_id or scontrol is None:
        return {"requeued": False, "detail": "not a Slurm job" if not job_id else "scontrol not found"}
    try:
        proc = subprocess.run(
            [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"requeued": False, "detail": f"scontrol requeue {job_id}: {err}"}
    if proc.returncode != 0:
        return {"requeued": False, "detail": f"scontrol requeue {job_id}: {proc.stderr.strip() or proc.returncode}"}
    return {"requeued": True, "detail": f"job {job_id} requeued"}


def persist_on_preempt(err: Preempted, save: Callable[[None], dict[str, Any]], stopped: float) -> dict[str, Any]:
    """After the workers stopped: persist through the agent's save-on-failure hook (across nodes every
    node waits for the decider's commit); the timeline of the notice, for the journal and the summary."""
    t0 = time.time()
    try:
        saved = save(None)
    except Exception as exc:  # the exit must still happen, and say why nothing was persisted
        log.exception("persist on preemption failed")
        saved = {"persisted": False, "detail": f"{type(exc).__name__}: {exc}"}
    done = time.time()
    return {
        "signal": signal.Signals(err.signum).name,
        "received": err.received,
        "workers_stopped": stopped,
        "persisted_at": done,
        "persist_s": round(done - t0, 3),
        "save": saved,
    }


def wait_for_peers(
    status: Callable[[], dict[str, Any]], since: float, timeout_s: float = 10.0, fresh_s: float = 5.0
) -> bool:
    """On the node that hosts the master, before it requeues and stops the master: wait (bounded) until
    every node alive at the notice (``since``, on this host's clock, the master's) has journaled its own
    ``preempted`` incident — Slurm signals them all at once, a master gone first loses theirs, and a
    requeue lets Slurm kill them. A node's beats stop with its workers, so "alive" is judged at the
    notice, not now. True when all did."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = status()
        live = {
            n["node_id"] for n in state["nodes"] if n["state"] == "alive" and n["last_heartbeat"] >= since - fresh_s
        }
        journaled = {i.get("node_id") for i in state["incidents"] if i["kind"] == "preempted"}
        if live <= journaled or time.monotonic() > deadline:
            return live <= journaled
        time.sleep(0.1)


def journal(client: MasterClient, node_id: str, record: dict[str, Any]) -> None:
    """The ``preempted`` incident, with a short retry: the master may be going away with its node."""
    from stalwart.launch.client import MasterError

    times = {"fault": record["received"], "detected": record["received"], "stopped": record["workers_stopped"]}
    try:
        client.call(
            "POST",
            "/v1/incidents",
            {"kind": "preempted", "node_id": node_id, "class": "preemption", "times": times, "details": record},
            retry_for_s=2.0,
        )
    except (MasterError, OSError) as exc:
        log.error("could not journal the preemption: %s", exc)
