"""The keeper's serving loop once a job needs it (torch and DCP imported): job after job in the node's
directory while the agent runs, or the one job of a keeper a worker started. See keeper_process for the
process around it, which waits for the first job without these imports."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from stalwart.checkpoint.keeper import Keeper, log
from stalwart.checkpoint.keeper_process import LOG_FORMAT, StopRequest, holds_no_job, next_job
from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.replicator import ReplicaConfig, Replicator
from stalwart.checkpoint.shm_gc import DEFAULT_KEEP_S, mark_kept


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


_job_log: tuple[str, logging.Handler] | None = None


def _log_also_to(path: str | None) -> None:
    """The agent's keeper logs to the agent's run directory and also where the workers asked
    (``keeper_log`` in job.json), where a keeper they started would have logged."""
    global _job_log
    if not path or (_job_log and _job_log[0] == path):
        return
    root = logging.getLogger()
    if _job_log:
        root.removeHandler(_job_log[1])
        _job_log[1].close()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    _job_log = (path, handler)


def serve(node: NodeJob, stop: StopRequest, poll_s: float = 0.02, status_copy: Path | None = None) -> int:
    """Serve ``node``'s directory for as long as the agent runs: wait for workers to write job.json,
    keep their snapshots, start over when a job completes (its directory removed), until stopped."""
    _one_thread()
    node.root.mkdir(parents=True, exist_ok=True)
    config, replicator = ReplicaConfig.from_env(), None
    try:
        replicator = Replicator(node, config) if config else None
    except OSError as err:  # e.g. --replica-host not an address of this host: persist anyway, say so
        log.error("replicas off for this node: cannot serve on %s: %s", config.host if config else "?", err)
    try:
        _serve_jobs(node, stop, poll_s, status_copy)
    finally:
        if replicator is not None:
            replicator.stop()
    if holds_no_job(node.root):
        shutil.rmtree(node.root, ignore_errors=True)  # nothing of a job in it: leave no litter in shm
    elif not node.paths.kept.exists():  # snapshots the final pass left (memory-only, or it was cut short)
        keep_s = float((node.job().get("policy") or {}).get("keep_shm_s", DEFAULT_KEEP_S))
        log.warning("%s", mark_kept(node.paths, keep_s, stop.why or "the agent stopped"))
    return 0


def _serve_jobs(node: NodeJob, stop: StopRequest, poll_s: float, status_copy: Path | None) -> None:
    """Serve job after job until stopped. A job whose workers wrote job.json before this keeper got to it
    (a short job, a slow start) still gets its final pass: stopped, it is served once, which only finishes."""
    while (job := next_job(node.root, stop, poll_s)) is not None:
        _log_also_to(job.get("keeper_log"))
        try:
            served = Keeper(node, poll_s, stop, status_copy).run()
        except Exception as err:
            log.error("cannot serve %s: %r", node.root, err)
            served = False
        if stop():
            return
        if not served:  # another keeper (started by an earlier job's worker) serves it: until it exits
            time.sleep(1.0)


def serve_one(root: Path, poll_s: float) -> None:
    """A keeper a worker started (no agent): this one job, then exit."""
    _one_thread()
    Keeper(NodeJob(root), poll_s).run()
