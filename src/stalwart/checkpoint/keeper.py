"""The keeper: one process per node and job that outlives the workers.

It watches the shared-memory snapshots, persists them to storage per policy (DCP format, see
:mod:`stalwart.checkpoint.persist`), runs save-on-failure when a worker dies, and removes the
snapshots when the job completes. Without ``stalwart run`` the first local rank 0 starts it
(``python -m stalwart.checkpoint JOB_DIR``) in its own session, so neither a SIGKILL of a
worker nor TorchElastic's process-group kill reaches it; a worker that finds it dead starts another.
The node agent of ``stalwart run`` will own it instead and call :func:`save_on_failure` directly.

Persistence never blocks training: a snapshot that gets overwritten before the keeper pins it is
skipped, and persist requests that arrive while a persist runs are coalesced into the newest one —
both are logged with the steps concerned.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.checkpoint import multinode
from stalwart.checkpoint.persist import retention, write_checkpoint
from stalwart.checkpoint.snapshot import JobPaths, SnapshotView, atomic_write, complete_slots, pid_alive, read_json
from stalwart.checkpoint.storage import Storage, step_name

log = logging.getLogger("stalwart.checkpoint.keeper")
_DROP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_", "TORCH_NCCL_", "NCCL_ASYNC")


# -- shared by the keeper and the agent's save-on-failure ---------------------------------------------
def _persist_lock(paths: JobPaths) -> int:
    """Serialise persists of one job (keeper and an agent's save-on-failure may both try)."""
    fd = os.open(paths.root / "persist.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def job_world(paths: JobPaths) -> int | None:
    for r in paths.ranks():
        owner = read_json(paths.owner(r))
        if owner:
            return int(owner["world_size"])
    return None


def node_ranks(paths: JobPaths, world: int) -> list[int]:
    """The ranks whose snapshots this node holds (all of them on a single-node job)."""
    ranks = (read_json(paths.job) or {}).get("ranks")
    return [int(r) for r in ranks] if ranks else list(range(world))


def snapshot_steps(paths: JobPaths, world: int, ranks: list[int] | None = None) -> dict[int, dict[int, dict[str, Any]]]:
    """rank → {step: header} of complete snapshots taken at this world size (this node's ranks)."""
    out = {}
    for r in ranks if ranks is not None else range(world):
        out[r] = {}
        for s in complete_slots(paths, r):
            if s.header.get("world_size") == world:
                out[r].setdefault(s.step, s.header)
    return out


def agreed(steps: dict[int, dict[int, Any]]) -> set[int]:
    return set.intersection(*(set(v) for v in steps.values())) if steps else set()


def persist_step(paths: JobPaths, storage: Storage, step: int, world: int, source: str,
                 ranks: list[int] | None = None, ask_others: bool = False) -> dict[str, Any]:
    """Pin this node's snapshots of ``step`` (``ranks``, default all) and write them as one committed
    checkpoint — with the other nodes' keepers when the job spans nodes (:mod:`.multinode`;
    ``ask_others`` for a step they would not pick by themselves). Returns the manifest, with
    ``already: True`` when a committed checkpoint covers the step (the keeper and the agent's
    save-on-failure may race for it). Raises LookupError/BlockingIOError when a snapshot is gone."""
    ranks = list(range(world)) if ranks is None else ranks
    fd = _persist_lock(paths)
    views: dict[int, SnapshotView] = {}
    try:
        done = storage.committed()  # decided under the lock: never rewrite what another persist committed
        if done and done[0] >= step:
            return {**(storage.manifest(done[0]) or {}), "already": True, "commit_s": 0.0}
        for r in ranks:
            info = next((s for s in complete_slots(paths, r) if s.step == step), None)
            if info is None:
                raise LookupError(f"rank {r} no longer holds a snapshot of step {step}")
            views[r] = SnapshotView(paths, info)
        if len(ranks) == world:
            return write_checkpoint(storage, step, [views[r] for r in range(world)], source)
        if ask_others:
            multinode.request(storage, step)
        return multinode.persist(storage, step, views, world, source, coordinator=0 in ranks)
    except (LookupError, BlockingIOError) as err:
        if len(ranks) < world and not isinstance(err, multinode.MissingSnapshot):  # nobody should wait for us
            if 0 in ranks:
                multinode.abort(storage, step, str(err))
            else:
                multinode.answer_missing(storage, step, ranks, str(err))
        raise
    finally:
        for v in views.values():
            v.close()
        os.close(fd)


def save_on_failure(job_dir: str | Path, storage_url: str | None = None,
                    storage_options: dict[str, Any] | None = None, world_size: int | None = None,
                    quiet: bool = False) -> dict[str, Any]:
    """Persist the newest snapshot that every rank holds, unless it is already committed.

    The agent calls this when a worker dies. It never persists a step that some rank lacks (that
    would mix states of different steps) and says in the result and the log why it did nothing.
    """
    paths = JobPaths(job_dir)
    job = read_json(paths.job) or {}
    storage = Storage(storage_url or job["storage"], storage_options if storage_options is not None
                      else job.get("storage_options"))
    world = world_size or job_world(paths)

    def outcome(persisted: bool, step: int | None, detail: str) -> dict[str, Any]:
        if not quiet:
            (log.info if persisted else log.warning)("save-on-failure: %s", detail)
        return {"persisted": persisted, "step": step, "detail": detail}

    if not world:
        return outcome(False, None, f"no snapshots under {paths.root}")
    ranks = node_ranks(paths, world)
    if 0 not in ranks:
        return outcome(False, None, "rank 0's node coordinates save-on-failure; this node's keeper takes part")
    steps = snapshot_steps(paths, world, ranks)
    common = agreed(steps)
    if not common:
        held = ", ".join(f"rank {r}: {sorted(s) or 'none'}" for r, s in steps.items())
        return outcome(False, None, f"ranks do not agree on a step ({held}); nothing persisted")
    committed = storage.committed()
    # Across nodes the newest step here may be missing elsewhere (a rank died mid-copy): try older ones.
    for step in sorted(common, reverse=True):
        if committed and committed[0] >= step:
            return outcome(False, step, f"step {step} is already covered by committed {step_name(committed[0])}")
        try:
            manifest = persist_step(paths, storage, step, world, "save-on-failure", ranks, ask_others=True)
        except multinode.MissingSnapshot as err:
            log.warning("save-on-failure: %s; trying an older step", err)
            continue
        if manifest.get("already"):
            return outcome(False, step, f"step {step} is already covered by committed step {manifest.get('step')}")
        return outcome(True, step, f"persisted step {step} ({manifest['bytes'] / 2**20:.1f} MiB in "
                                   f"{manifest['commit_s']:.2f} s) to {storage.path(step_name(step))}")
    return outcome(False, None, f"no step held by this node ({sorted(common)}) is held by every node")


# -- the keeper loop --------------------------------------------------------------------------------
class Keeper:
    def __init__(self, paths: JobPaths, poll_s: float = 0.02) -> None:
        self.paths, self.poll_s = paths, poll_s
        self.job: dict[str, Any] = read_json(paths.job) or {}
        if "storage" not in self.job:
            raise ValueError(f"{paths.job} is missing or has no storage URL")
        self.storage = Storage(self.job["storage"], self.job.get("storage_options"))
        self.storage.refresh()
        self.last_persisted = self.storage.latest() or -1
        self.last_persist_time = time.monotonic()
        self.handled_pids: set[int] = set()
        self.given_up: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {"pid": os.getpid(), "started": time.time(), "last_committed": self.last_persisted}
        # Multi-node: this node's ranks; only the keeper on rank 0's node decides, commits and tidies.
        ranks = self.job.get("ranks")
        self.coordinator = not ranks or 0 in ranks
        self.request_checked = 0.0

    def event(self, kind: str, step: int | None, detail: str, level: int = logging.INFO) -> None:
        log.log(level, "%s%s: %s", kind, f" step {step}" if step is not None else "", detail)
        self.events = (self.events + [{"time": time.time(), "kind": kind, "step": step, "detail": detail}])[-50:]
        self.status.update(events=self.events, last_committed=self.last_persisted)
        atomic_write(self.paths.keeper_status, json.dumps(self.status).encode())

    def policy(self, key: str, default: Any = 0) -> Any:
        return self.job.get("policy", {}).get(key, default)

    def run(self) -> int:
        lock = os.open(self.paths.keeper_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another keeper already serves %s", self.paths.root)
            return 0
        self.event("start", None, f"keeper pid {os.getpid()} for {self.paths.root} → {self.storage.url} "
                                  f"(latest committed: {self.last_persisted if self.last_persisted >= 0 else 'none'})")
        self._tidy_storage()
        idle_since: float | None = None
        while True:
            if not self.paths.root.is_dir():
                log.info("job directory %s removed; exiting", self.paths.root)
                return 0
            world = job_world(self.paths)
            ranks = node_ranks(self.paths, world) if world else []
            owners = {r: read_json(self.paths.owner(r)) for r in ranks}
            if world and all(self._closed(r, o) for r, o in owners.items()):
                if self._finish(world, "all ranks closed the checkpointer: job complete"):
                    return 0
            if world:
                self._check_failures(world, owners)
                self._maybe_persist(world, ranks)
            attached = workers_attached(self.paths)
            idle_since = None if attached else (idle_since or time.monotonic())
            idle_s = float(self.policy("idle_s", 120.0))
            if idle_since is not None and time.monotonic() - idle_since > idle_s:
                if self._finish(world or 0, f"no worker attached for {idle_s} s"):
                    return 0
                idle_since = None
            time.sleep(self.poll_s)

    def _closed(self, rank: int, owner: dict[str, Any] | None) -> bool:
        closed = read_json(self.paths.closed(rank))
        return bool(owner and closed and closed.get("pid") == owner.get("pid"))

    def _check_failures(self, world: int, owners: dict[int, dict[str, Any] | None]) -> None:
        for r, owner in owners.items():
            if not owner or owner.get("world_size") != world or self._closed(r, owner):
                continue
            pid = int(owner["pid"])
            if pid in self.handled_pids or pid_alive(pid):
                continue
            self.handled_pids.add(pid)
            self.event("worker-died", None, f"rank {r} (pid {pid}) died; saving on failure", logging.WARNING)
            try:
                result = save_on_failure(self.paths.root, self.storage.url, self.job.get("storage_options"), world,
                                         quiet=True)
            except Exception as err:  # noqa: BLE001 — a failed save must not kill the keeper
                self.event("save-on-failure-failed", None, repr(err), logging.ERROR)
                continue
            if result["persisted"]:
                self.last_persisted = max(self.last_persisted, result["step"])
                self._retention()
            self.event("save-on-failure", result["step"], result["detail"])

    def _maybe_persist(self, world: int, ranks: list[int]) -> None:
        steps = snapshot_steps(self.paths, world, ranks)
        common = agreed(steps)
        flagged = [s for s in common if all(steps[r][s].get("persist") for r in steps)]
        every, every_s = int(self.policy("persist_every_steps")), float(self.policy("persist_every_s"))
        target = max(flagged, default=-1)
        if target <= self.last_persisted or target in self.given_up:
            target = -1
            newest = max(common, default=-1)
            if (self.coordinator and every_s > 0 and time.monotonic() - self.last_persist_time >= every_s
                    and newest > self.last_persisted):
                target = newest
        if target < 0 and not self.coordinator:
            target = self._requested(world, ranks, common)
        if target < 0:
            return
        if not self.coordinator:
            every = 0  # the coordinator reports coalesced steps
        due = [s for s in range(max(1, self.last_persisted + 1), target) if every > 0 and s % every == 0]
        if due:
            self.event("coalesced", target, f"persist of step(s) {due} was due while the previous persist "
                                            f"ran or before the keeper saw it; persisting step {target} instead",
                       logging.WARNING)
        self.last_persist_time = time.monotonic()
        try:
            manifest = persist_step(self.paths, self.storage, target, world, "keeper", ranks,
                                    ask_others=self.coordinator and target not in flagged)
        except (LookupError, BlockingIOError) as err:
            self.given_up.add(target)
            self.event("skipped", target, f"{err}: training outpaced persistence; the next due step will be "
                                          "persisted", logging.WARNING)
            return
        except Exception as err:  # noqa: BLE001 — storage errors are reported, the keeper carries on
            self.given_up.add(target)
            self.event("failed", target, f"persist failed: {err!r}", logging.ERROR)
            return
        self.last_persisted = target
        if manifest.get("already"):
            self.event("already-committed", target, f"committed step {manifest.get('step')} covers it")
            return
        mib = manifest["bytes"] / 2**20
        self.event("committed", target, f"{mib:.1f} MiB in {manifest['commit_s']:.2f} s "
                                        f"({mib / max(manifest['commit_s'], 1e-9):.0f} MiB/s) → "
                                        f"{self.storage.path(step_name(target))}")
        self._retention()

    def _requested(self, world: int, ranks: list[int], common: set[int]) -> int:
        """A step the coordinator asked for (save-on-failure, time-based) that we still hold, else -1;
        answers "missing" for one we no longer hold so the coordinator need not wait."""
        now = time.monotonic()
        if now - self.request_checked < 0.2:
            return -1
        self.request_checked = now
        self.storage.refresh()
        step = multinode.requested_step(self.storage)
        if step is None or step <= self.last_persisted or step in self.given_up:
            return -1
        if step in common:
            return step
        self.given_up.add(step)
        multinode.answer_missing(self.storage, step, ranks, f"this node holds steps {sorted(common)}")
        return -1

    def _retention(self) -> None:
        if not self.coordinator:
            return
        removed = retention(self.storage, int(self.policy("keep_last", 3)), int(self.policy("keep_every", 0)))
        if removed:
            log.info("retention removed step(s) %s", removed)

    def _tidy_storage(self) -> None:
        """Torn step directories (a persist that died) are never resumed from; remove them."""
        if not self.coordinator:
            return  # the coordinator may be committing one right now
        fd = _persist_lock(self.paths)
        try:
            latest = self.storage.latest()
            committed = set(self.storage.committed())
            for s in self.storage.steps():
                if s not in committed:
                    self.storage.remove(s)
                    self.event("removed-torn", s, f"{step_name(s)} had no manifest (a persist died mid-write; "
                                                  f"latest is {latest})", logging.WARNING)
            if latest is not None:  # stage files of finished steps; later ones may be in use by other nodes
                multinode.clear_stage(self.storage, below=latest + 1)
        finally:
            os.close(fd)

    def _finish(self, world: int, why: str) -> bool:
        """Exit, removing the snapshots if storage has everything they hold (otherwise keep them and
        say so). Returns False — keep running — if a worker attached meanwhile (a restart)."""
        lock = os.open(self.paths.job_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            return False
        try:
            ranks = node_ranks(self.paths, world) if world else []
            newest = max(agreed(snapshot_steps(self.paths, world, ranks)), default=-1) if world else -1
            self.storage.refresh()
            latest = self.storage.latest() or -1
            if newest > latest:
                self.event("exit", newest, f"{why}; keeping snapshots in {self.paths.root}: step {newest} is "
                                           f"newer than the last committed checkpoint ({latest})", logging.WARNING)
            else:
                self.event("exit", None, f"{why}; removing {self.paths.root}")
                shutil.rmtree(self.paths.root, ignore_errors=True)
            return True
        finally:
            os.close(lock)


# -- locks ------------------------------------------------------------------------------------------
def workers_attached(paths: JobPaths) -> bool:
    """True while some worker holds the job lock (released by the kernel when it dies)."""
    fd = os.open(paths.job_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def attach(paths: JobPaths) -> int:
    """Hold the job lock shared for the life of a worker (returns the fd). Retries if the keeper
    removed the directory between our open and our lock, so the lock is always on the live file."""
    while True:
        paths.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(paths.job_lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.fstat(fd).st_ino == os.stat(paths.job_lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


# -- starting one ---------------------------------------------------------------------------------
def keeper_alive(paths: JobPaths) -> bool:
    fd = os.open(paths.keeper_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def spawn_keeper(paths: JobPaths, log_path: str | Path | None) -> subprocess.Popen[bytes]:
    """Start a keeper in its own session (so signals to the worker's process group miss it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = open(log_path or paths.root / "keeper.log", "ab")  # noqa: SIM115 — handed to the child
    try:
        return subprocess.Popen([sys.executable, "-m", "stalwart.checkpoint", str(paths.root)],
                                start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, close_fds=True)
    finally:
        out.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stalwart.checkpoint",
                                     description="Persist shared-memory snapshots of one job (started by workers).")
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--poll-s", type=float, default=0.02)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper[%(process)d] %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    import torch

    torch.set_num_threads(1)
    return Keeper(JobPaths(args.job_dir), args.poll_s).run()
