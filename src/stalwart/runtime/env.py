"""The environment half of the worker ↔ agent contract: every variable a worker reads, in one typed place.

Variables are read once per process, lazily: a worker forked from the node's zygote gets its environment
after the fork, so nothing may be read at import time (the zygote imports this module) — and the zygote
calls ``stalwart.runtime.reset()`` in each forked child.

Names: torchrun's own (``RANK``, ``WORLD_SIZE``, ...) plus ``STALWART_*`` set by ``stalwart run`` or by a
parent command for its local workers. The chaos variables are the exception to "read once": see
``chaos_now()``. Stdlib only; imports nothing of stalwart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Set by `stalwart run` (the agent) for its workers.
ENV_PROGRESS_DIR = "STALWART_PROGRESS_DIR"  # per-rank progress records, incidents, fault times
ENV_MASTER = "STALWART_MASTER"  # job master URL
ENV_JOB_ID = "STALWART_JOB_ID"  # the rendezvous id: names the job's shared-memory directory
ENV_NODE_ID = "STALWART_NODE_ID"  # this agent's node id (multi-node checkpoint staging)
ENV_JOB_TOKEN = "STALWART_JOB_TOKEN"  # bearer token for the master (also read by CLI tools)
ENV_CHAOS = "STALWART_CHAOS"  # fault specs given at start (`--chaos`)
ENV_CHAOS_FILE = "STALWART_CHAOS_FILE"  # faults injected into a running job (`stalwart chaos`)
ENV_CHAOS_DIR = "STALWART_CHAOS_DIR"  # markers of once-faults that fired (survive restarts)
# Set by a parent command that prints the workers' report itself (`stalwart train --nproc`, check).
ENV_PARENT_REPORTS = "STALWART_PARENT_REPORTS"
# Set by `stalwart check` for its local workers: ranks per simulated node, and burn-ins one node at a time.
ENV_RANKS_PER_NODE = "STALWART_RANKS_PER_NODE"
ENV_CHECK_SERIAL = "STALWART_CHECK_SERIAL"
# Set by the user (or a test): the default of `stalwart check --fault`.
ENV_CHECK_FAULT = "STALWART_CHECK_FAULT"
# Set by the agent for the zygote client (the warm-start worker command), not read by workers.
ENV_ZYGOTE_SOCKET = "STALWART_ZYGOTE"
ENV_ZYGOTE_PIDS = "STALWART_ZYGOTE_PIDS"  # directory: client pid → the forked worker's pid (stack dumps)
# Set by the user inside a Slurm allocation, read by `stalwart run`: the master's port (default: from the job id).
ENV_SLURM_PORT = "STALWART_SLURM_PORT"
# peer memory replicas: the agent tells its keeper (the key only to the keeper) and its workers (slots)
ENV_REPLICAS = "STALWART_REPLICAS"
ENV_REPLICA_HOST = "STALWART_REPLICA_HOST"
ENV_REPLICA_DOMAIN = "STALWART_REPLICA_DOMAIN"
ENV_REPLICA_KEY = "STALWART_REPLICA_KEY"
# "1": a step's save returns once its snapshot is in a peer's memory; "overlap": once the previous one's is
ENV_REPLICA_SYNC = "STALWART_REPLICA_SYNC"
REPLICA_OVERLAP = "overlap"
ENV_FAILURE_DOMAIN = "STALWART_FAILURE_DOMAIN"  # the user's: --replica-domain's default
ENV_SNAPSHOT_SLOTS = "STALWART_SNAPSHOT_SLOTS"
# "1": every node's agent talks to the master in ENV_MASTER (`--master`, Slurm's), so the checkpoint
# decider lives there; otherwise a job across nodes has it in rank 0's keeper (checkpoint/desk_host.py).
ENV_SHARED_MASTER = "STALWART_SHARED_MASTER"
# How long a worker whose script returned may take to end (threads, exit handlers) before it is ended.
ENV_EXIT_GRACE = "STALWART_EXIT_GRACE_S"
# The execution the workers belong to (the rendezvous round: the same integer on every node of one
# execution, larger after every restart or regrouping). Checkpoint coordination compares these, never clocks.
ENV_EPOCH = "STALWART_EPOCH"
# One launch of a node's agent (a fresh id per `stalwart run`): a Slurm requeue starts a new rendezvous
# whose rounds count from 0 again, and the checkpoint decider tells it from a late report by this id.
ENV_AGENT = "STALWART_AGENT"
# The tmpfs root for snapshots (default /dev/shm): the agent's keeper and its workers read the same.
ENV_SHM_DIR = "STALWART_SHM_DIR"
EXIT_GRACE_S = 30.0


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    value = environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be a number of seconds") from None
    if not 0 < number < float("inf"):
        raise ValueError(f"environment variable {name}={value!r} must be a positive, finite number of seconds")
    return number


@dataclass(frozen=True)
class WorkerEnv:
    """What this worker process was told by its launcher. Empty strings mean "not set"."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0  # the node's rank in the rendezvous round
    restart_count: int = 0  # TorchElastic's: > 0 in workers restarted within this launch
    epoch: int = 0  # ENV_EPOCH; without an agent that sets it, TorchElastic's restart count
    epoch_from_restarts: bool = True  # no ENV_EPOCH: the checkpointer agrees on one across nodes
    launched: bool = False  # a launcher set RANK and WORLD_SIZE (torchrun, stalwart run, --nproc)
    progress_dir: str = ""
    master: str = ""
    job_id: str = ""
    node_id: str = ""
    job_token: str = ""
    chaos: str = ""
    chaos_file: str = ""
    chaos_dir: str = ""
    parent_reports: bool = False
    ranks_per_node: int = 0  # 0: not set (one node = local_world_size ranks)
    check_serial: bool = False
    check_fault: str = ""
    exit_grace_s: float = EXIT_GRACE_S  # a returned script's process ends within this (``lifetime``)

    @property
    def under_agent(self) -> bool:
        """Started by a stalwart agent (which reads progress records and keeps snapshots)."""
        return bool(self.progress_dir)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        e = os.environ if environ is None else environ
        return cls(
            rank=_int(e, "RANK", 0),
            world_size=_int(e, "WORLD_SIZE", 1),
            local_rank=_int(e, "LOCAL_RANK", 0),
            local_world_size=_int(e, "LOCAL_WORLD_SIZE", 1),
            group_rank=_int(e, "GROUP_RANK", 0),
            restart_count=_int(e, "TORCHELASTIC_RESTART_COUNT", 0),
            epoch=_int(e, ENV_EPOCH, _int(e, "TORCHELASTIC_RESTART_COUNT", 0)),
            epoch_from_restarts=ENV_EPOCH not in e,
            launched="RANK" in e and "WORLD_SIZE" in e,
            progress_dir=e.get(ENV_PROGRESS_DIR, ""),
            master=e.get(ENV_MASTER, ""),
            job_id=e.get(ENV_JOB_ID, ""),
            node_id=e.get(ENV_NODE_ID, ""),
            job_token=e.get(ENV_JOB_TOKEN, ""),
            chaos=e.get(ENV_CHAOS, ""),
            chaos_file=e.get(ENV_CHAOS_FILE, ""),
            chaos_dir=e.get(ENV_CHAOS_DIR, ""),
            parent_reports=bool(e.get(ENV_PARENT_REPORTS)),
            ranks_per_node=_int(e, ENV_RANKS_PER_NODE, 0),
            check_serial=bool(e.get(ENV_CHECK_SERIAL)),
            check_fault=e.get(ENV_CHECK_FAULT, ""),
            exit_grace_s=_float(e, ENV_EXIT_GRACE, EXIT_GRACE_S),
        )


_current: WorkerEnv | None = None


def worker_env() -> WorkerEnv:
    """This process's contract, read from the environment on first use."""
    global _current
    if _current is None:
        _current = WorkerEnv.from_environ()
    return _current


def reset() -> None:
    """Forget what was read (``stalwart.runtime.reset()`` also drops the progress writer)."""
    global _current
    _current = None


def chaos_now() -> tuple[str, str]:
    """(spec, spec file) of fault injection as the environment says *now*: two dict lookups per check.

    Not cached, unlike ``worker_env()``: ``stalwart run`` sets ``STALWART_CHAOS*`` in its own process
    after start and applies node faults there itself, and tests change them between checks.
    """
    e = os.environ
    return e.get(ENV_CHAOS, ""), e.get(ENV_CHAOS_FILE, "")


def chaos_marker_dir() -> str:
    """``STALWART_CHAOS_DIR`` as the environment says now ("" = not set), read when a fault fires."""
    return os.environ.get(ENV_CHAOS_DIR, "")
