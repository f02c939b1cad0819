"""The worker ↔ agent contract, in one place that any layer may import.

- ``env``: every environment variable a worker is told by its launcher (``WorkerEnv``, read lazily
  once by ``worker_env()``) and the ``ENV_*`` names the launcher sets them by;
- ``progress``: the worker's half of the progress channel (the 64-byte seqlocked record per rank, its
  file naming, ``report``/``phase``/``finished``/``incident``); the agent reads it with
  ``stalwart.launch.progress.ProgressReader``.

Stdlib only, and it imports nothing of stalwart outside this package, so the trainer, the
checkpointer, a user's script and the launcher's reader side can all depend on it. A worker forked
from the node's zygote calls ``reset()`` first: the zygote imported this package before the fork.
"""

from stalwart.runtime.env import (
    ENV_AGENT,
    ENV_CHAOS,
    ENV_CHAOS_DIR,
    ENV_CHAOS_FILE,
    ENV_CHECK_FAULT,
    ENV_CHECK_SERIAL,
    ENV_EPOCH,
    ENV_EXIT_GRACE,
    ENV_FAILURE_DOMAIN,
    ENV_JOB_ID,
    ENV_JOB_TOKEN,
    ENV_MASTER,
    ENV_NODE_ID,
    ENV_PARENT_REPORTS,
    ENV_PROGRESS_DIR,
    ENV_RANKS_PER_NODE,
    ENV_REPLICA_DOMAIN,
    ENV_REPLICA_HOST,
    ENV_REPLICA_KEY,
    ENV_REPLICA_SYNC,
    ENV_REPLICAS,
    ENV_SHARED_MASTER,
    ENV_SHM_DIR,
    ENV_SLURM_PORT,
    ENV_SNAPSHOT_SLOTS,
    ENV_ZYGOTE_PIDS,
    ENV_ZYGOTE_SOCKET,
    EXIT_GRACE_S,
    REPLICA_OVERLAP,
    WorkerEnv,
    chaos_marker_dir,
    chaos_now,
    worker_env,
)
from stalwart.runtime.lifetime import die_with_parent, exit_process
from stalwart.runtime.progress import (
    PHASES,
    ProgressWriter,
    fault_fired,
    fault_path,
    finished,
    incident,
    incidents_path,
    metrics_path,
    phase,
    record_path,
    report,
    writer,
)
from stalwart.runtime.sections import set_section_timer, timer


def reset() -> None:
    """Forget everything read from the environment and the progress writer built from it (the
    zygote's forked child, before it runs the worker; tests that change the environment)."""
    from stalwart.runtime import env, progress

    env.reset()
    progress.reset_writer()


__all__ = [
    "ENV_AGENT",
    "ENV_CHAOS",
    "ENV_CHAOS_DIR",
    "ENV_CHAOS_FILE",
    "ENV_CHECK_FAULT",
    "ENV_CHECK_SERIAL",
    "ENV_EPOCH",
    "ENV_EXIT_GRACE",
    "ENV_FAILURE_DOMAIN",
    "ENV_JOB_ID",
    "ENV_JOB_TOKEN",
    "ENV_MASTER",
    "ENV_NODE_ID",
    "ENV_PARENT_REPORTS",
    "ENV_PROGRESS_DIR",
    "ENV_RANKS_PER_NODE",
    "ENV_REPLICAS",
    "ENV_REPLICA_DOMAIN",
    "ENV_REPLICA_HOST",
    "ENV_REPLICA_KEY",
    "ENV_REPLICA_SYNC",
    "ENV_SHARED_MASTER",
    "ENV_SHM_DIR",
    "ENV_SLURM_PORT",
    "ENV_SNAPSHOT_SLOTS",
    "ENV_ZYGOTE_PIDS",
    "ENV_ZYGOTE_SOCKET",
    "EXIT_GRACE_S",
    "PHASES",
    "REPLICA_OVERLAP",
    "ProgressWriter",
    "WorkerEnv",
    "chaos_marker_dir",
    "chaos_now",
    "die_with_parent",
    "exit_process",
    "fault_fired",
    "fault_path",
    "finished",
    "incident",
    "incidents_path",
    "metrics_path",
    "phase",
    "record_path",
    "report",
    "reset",
    "set_section_timer",
    "timer",
    "worker_env",
    "writer",
]
