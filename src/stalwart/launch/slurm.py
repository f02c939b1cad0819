"""Slurm awareness for `stalwart run`: inside an allocation, `srun stalwart run train.py` needs no flags.

One agent runs per Slurm task (``srun --ntasks-per-node=1`` for one per node), so the job's "nodes"
are the step's tasks: their count is ``--nnodes``, the task id the node rank. The first host of the
allocation (``SLURM_JOB_NODELIST``) hosts the job master, and the master serves the rendezvous store
(``stalwart master --rdzv-port``), so no agent's loss takes the rendezvous with it. Everything here is
pure (environment in, settings out); ``apply`` changes only flags the user left at their defaults:
explicit flags win.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stalwart.runtime import ENV_SLURM_PORT as ENV_PORT  # the master's port (the store's is the next one)

PORT_BASE, PORT_SPAN = 20000, 20000


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,7],gpu-a[1-2]b``) as host names, in order, as
    ``scontrol show hostnames`` prints them (zero padding kept)."""
    hosts: list[str] = []
    for item in _split_top(hostlist.strip()):
        if item:
            hosts.extend(_expand_item(item))
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in Slurm host list {text!r}")
    parts.append(text[start:])
    return parts


def _expand_item(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    names: list[str] = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in Slurm host list item {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            names.append(f"{head}{n:0{width}d}")
    return [name + rest for name in names for rest in _expand_item(tail)] if "[" in tail else [n + tail for n in names]


@dataclass(frozen=True)
class SlurmStep:
    """What `stalwart run` takes from one Slurm task's environment."""

    job_id: str
    ntasks: int  # agents in the step: the job's --nnodes
    task: int  # this agent's node rank
    first_host: str  # hosts the master and the rendezvous store
    restart_count: int  # how often the job was requeued

    @property
    def port(self) -> int:
        """The master's port: from the job id, so every task computes the same one without talking."""
        return PORT_BASE + (int(re.sub(r"\D", "", self.job_id) or 0) * 2) % PORT_SPAN

    @property
    def hosts_master(self) -> bool:
        return self.task == 0


def from_env(env: Mapping[str, str]) -> SlurmStep | None:
    """The Slurm step this process is a task of, or None outside one (no ``SLURM_JOB_ID`` or no task
    id: ``sbatch``'s batch shell itself is not a task of a step)."""
    job_id = env.get("SLURM_JOB_ID")
    task = env.get("SLURM_PROCID")
    if not job_id or task is None:
        return None
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    hosts = expand_hostlist(nodelist) if nodelist else []
    return SlurmStep(
        job_id=job_id,
        ntasks=int(ntasks),
        task=int(task),
        first_host=hosts[0] if hosts else "localhost",
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
    )


def apply(args: argparse.Namespace, parser: argparse.ArgumentParser, step: SlurmStep, env: Mapping[str, str]) -> None:
    """Fill the flags left at their defaults from the step: ``--rdzv-id`` (the job id: a requeued job
    finds its run directory and checkpoints again), ``--nnodes``/``--node-rank`` and, with more than
    one task, the job master on the first host (``--master``; task 0 starts it, see
    ``master_address``)."""

    def default(name: str) -> bool:
        return getattr(args, name) == parser.get_default(name)

    if default("rdzv_id"):
        args.rdzv_id = f"slurm-{step.job_id}"
    if step.ntasks <= 1 or args.standalone:
        return
    if default("nnodes"):
        args.nnodes = str(step.ntasks)
    if default("node_rank"):
        args.node_rank = step.task
    if default("rdzv_backend") and not args.rdzv_endpoint:
        args.rdzv_backend = "c10d"  # the endpoint: the store the master serves
    if args.master is None:
        args.master = master_address(step, env)


def master_address(step: SlurmStep, env: Mapping[str, str]) -> str:
    port = int(env.get(ENV_PORT) or step.port)
    return f"http://{step.first_host}:{port}"


def wait_for_token(path: Path, timeout_s: float = 120.0) -> str:
    """The job token task 0 writes into the (shared) run directory."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and (token := path.read_text().strip()):
            return token
        time.sleep(0.2)
    raise ValueError(
        f"no job token in {path} after {timeout_s:.0f} s: Slurm task 0 writes it there (the run directory must be "
        "on a shared file system), or set STALWART_JOB_TOKEN for every task"
    )
