"""Local workers without a launcher (`stalwart train --nproc N`, `stalwart check`): TorchElastic.

The parent command validates its input first (the trainer's config, its data), so a mistake fails
once, before any worker starts; the workers are plain `python -m stalwart COMMAND ...` processes under
torch's own elastic agent (c10d rendezvous on a free local port), exactly as `torchrun --standalone`
runs them.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from stalwart import _compat
from stalwart.errors import WorkersFailed


def spawn_local(nproc: int, worker_argv: list[str], env: dict[str, str] | None = None) -> None:
    """Run ``python -m stalwart *worker_argv`` in ``nproc`` local workers with ``env`` added to their
    environment; WorkersFailed names the rank that most likely caused a failure."""
    if nproc < 1:
        raise ValueError(f"--nproc must be ≥ 1, got {nproc}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"stalwart-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    _compat.rendezvous_poll(1)  # one node: no skew before its round (torch's is 0-0.3 s), a 50 ms poll
    _compat.quick_agent_paths()  # nor ~0.2 s naming the round's log events by inspecting the stack
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        elastic_launch(config, sys.executable)("-m", "stalwart", *worker_argv)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items(), key=lambda kv: (_consequence(kv[1].exitcode), kv[1].timestamp, kv[0]))
        raise WorkersFailed(
            f"worker rank {rank} failed (exit code {failure.exitcode}): {failure.message or 'see its output above'}"
        ) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _consequence(exitcode: int) -> int:
    """0 for a likely cause (killed by a signal: SIGKILL, SIGSEGV, ...), 1 for an exit code (peers
    failing fast on a broken collective look like this), 2 for SIGTERM/SIGINT (the launcher stopping
    the rest). Failure timestamps are whole seconds, so time alone often cannot tell them apart."""
    if exitcode < 0:
        return 2 if -exitcode in (signal.SIGTERM, signal.SIGINT) else 0
    return 1
