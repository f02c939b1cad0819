"""Start a node's keeper process (``python -m stalwart.checkpoint JOB_DIR``) in its own session.

Its own small module: a worker that starts a keeper (no agent on the node) imports this, not the
keeper's modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.shm import secure_job_dir

# A keeper must not look like a worker to torch (nor inherit NCCL's watchdog settings).
_DROP_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "NCCL_ASYNC",
)


def spawn_keeper(
    job: NodeJob,
    log_path: str | Path | None,
    parent: int | None = None,
    grace_s: float | None = None,
    status_copy: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a keeper in its own session (so signals to the workers' or the agent's process group miss
    it). With ``parent`` it serves the directory for as long as that process (the agent) lives;
    ``status_copy``: also keep its status there (it outlives the directory, for the job report)."""
    secure_job_dir(job.root)
    extra, env = env or {}, {k: v for k, v in os.environ.items() if not k.startswith(_DROP_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    cmd = [sys.executable, "-m", "stalwart.checkpoint", str(job.root)]
    if parent is not None:
        cmd += ["--parent", str(parent)]
    if grace_s is not None:
        cmd += ["--grace-s", str(grace_s)]
    if status_copy is not None:
        cmd += ["--status-copy", str(status_copy)]
    out = open(log_path or job.root / "keeper.log", "ab")
    try:
        return subprocess.Popen(
            cmd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
        )
    finally:
        out.close()
