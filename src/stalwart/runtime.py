"""The worker ↔ agent contract: every environment variable a worker reads, in one typed place.

Stdlib only, and it imports nothing of stalwart, so any layer (the trainer, the checkpointer, a user's
script, the launcher's reader side) can depend on it. Variables are read once per process, lazily:
a worker forked from the node's zygote gets its environment after the fork, so nothing may be read at
import time (the zygote imports this module) — and the zygote calls ``reset()`` in each forked child.

Names: torchrun's own (``RANK``, ``WORLD_SIZE``, ...) plus ``STALWART_*`` set by ``stalwart run``.
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


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


@dataclass(frozen=True)
class WorkerEnv:
    """What this worker process was told by its launcher. Empty strings mean "not set"."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0  # the node's rank in the rendezvous round
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
        )


_current: WorkerEnv | None = None


def worker_env() -> WorkerEnv:
    """This process's contract, read from the environment on first use."""
    global _current
    if _current is None:
        _current = WorkerEnv.from_environ()
    return _current


def reset() -> None:
    """Forget what was read (the zygote's forked child, tests that change the environment)."""
    global _current
    _current = None
