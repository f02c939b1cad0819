"""Storage faults (docs/checkpoint.md "Storage faults"). The keeper's :class:`StorageHealth` classifies a
failed persist by cause, backs off, rate-limits its log and journals one ``storage`` incident per run of
failures (and a ``recovered`` one); the workers stop with :class:`StorageUnavailableError` when failing
storage puts too much at risk (:class:`AtRiskPolicy`) and say so on the console (:class:`StorageNews`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("stalwart.checkpoint.keeper")

CAUSES = ("full", "permission", "unreachable", "timeout", "torn", "error")
# In the job's shm directory, or beside the agent's status copy (it outlives that directory, so the
# final pass's records still reach the agent, which forwards each line).
INCIDENTS_FILE = "storage.incidents.jsonl"
_ERRNO = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "full",
    errno.EFBIG: "full",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EROFS: "permission",
    errno.ETIMEDOUT: "timeout",
    errno.ECONNREFUSED: "unreachable",
    errno.ECONNRESET: "unreachable",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.EHOSTDOWN: "unreachable",
    errno.ENOTCONN: "unreachable",
}
# Messages of errors that carry no errno (botocore, aiohttp, torch's zip writer), lower case.
_TEXT = (
    ("full", ("no space left", "quota exceeded", "entitytoolarge")),
    ("permission", ("permission denied", "read-only file system", "accessdenied", "access denied", "forbidden")),
    ("timeout", ("timed out", "timeout")),
    ("unreachable", ("could not connect", "connection refused", "endpointconnectionerror", "connection reset")),
    ("unreachable", ("cannot connect to host", "name or service not known", "connection aborted")),
    ("torn", ("unexpected pos", "torn", "short write", "incomplete")),
)


def _chain(err: BaseException) -> list[BaseException]:
    """The error, its causes and contexts, and the per-rank failures DCP wraps in CheckpointException."""
    seen: list[BaseException] = []
    todo = [err]
    while todo and len(seen) < 32:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]  # type: ignore[list-item]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
    return seen


def classify(err: BaseException) -> str:
    """The cause of a storage error (one of ``CAUSES``): an errno anywhere in the chain wins, then the
    error's type and text (object stores and torch's zip writer say it in words)."""
    chain = _chain(err)
    for e in chain:
        if isinstance(e, OSError) and e.errno in _ERRNO:
            return _ERRNO[e.errno]
    for e in chain:
        if isinstance(e, TimeoutError):
            return "timeout"
        if isinstance(e, PermissionError):
            return "permission"
        if isinstance(e, ConnectionError):
            return "unreachable"
    text = " ".join(f"{type(e).__name__} {e}" for e in chain).lower()
    for cause, needles in _TEXT:
        if any(n in text for n in needles):
            return cause
    return "error"


class StorageHealth:
    """Failures of one keeper's persists, backoff and the records to journal."""

    backoff_s = 1.0  # doubled per consecutive failure, up to max_backoff_s
    max_backoff_s = 30.0
    log_every_s = 30.0  # one log line per run of failures with the same cause, at most this often

    def __init__(self, url: str, incidents: Path | None) -> None:
        self.url, self.incidents = url, incidents
        self.failures = 0  # all failed attempts, ever
        self.streak = 0  # consecutive failed attempts since the last commit
        self.failing_since: float | None = None
        self.cause: str | None = None
        self.last_error = ""
        self.retry_at = 0.0  # monotonic: no new attempt before this
        self.last_committed = -1
        self.last_commit_time: float | None = None  # wall clock
        self._logged_at = 0.0
        self._folded = 0  # failures not logged since the last line
        self._journaled = False  # this run of failures has a storage incident (its recovery gets one too)

    def may_try(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.retry_at

    def failed(self, op: str, step: int | None, err: BaseException) -> str:
        """Record one failed attempt; logs (rate-limited), journals an incident when a run of failures
        starts or its cause changes, and sets the next retry time. Returns the cause."""
        cause = classify(err)
        new_episode = self.streak == 0 or cause != self.cause
        self.failures += 1
        self.streak += 1
        self.cause, self.last_error = cause, f"{type(err).__name__}: {err}"[:500]
        self.failing_since = self.failing_since or time.time()
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.streak - 1))
        self.retry_at = time.monotonic() + delay
        now = time.monotonic()
        if new_episode or now - self._logged_at >= self.log_every_s:
            folded = f" ({self._folded} more failure(s) since the last report)" if self._folded else ""
            log.error(
                "storage %s: %s of step %s to %s failed: %s; training continues from memory, retry in %.0f s "
                "(failure %d in a row, last committed step: %s)%s",
                cause,
                op,
                step,
                self.url,
                self.last_error,
                delay,
                self.streak,
                self.last_committed if self.last_committed >= 0 else "none",
                folded,
            )
            self._logged_at, self._folded = now, 0
        else:
            self._folded += 1
        if new_episode:
            self._journaled = True
            self._journal(
                step,
                {"cause": cause, "op": op, "error": self.last_error, "failures": self.failures, "retry_in_s": delay},
            )
        return cause

    def committed(self, step: int) -> None:
        """A commit succeeded: a run of failures ends with a ``recovered`` record."""
        if self.streak and self._journaled:
            down = time.time() - (self.failing_since or time.time())
            log.warning(
                "storage recovered: step %d committed to %s after %d failed attempt(s) over %.0f s (%s)",
                step,
                self.url,
                self.streak,
                down,
                self.cause,
            )
            self._journal(
                step,
                {"recovered": True, "cause": self.cause, "failed_attempts": self.streak, "down_s": round(down, 3)},
            )
        self.streak, self.failing_since, self.retry_at, self._folded, self._journaled = 0, None, 0.0, 0, False
        self.last_committed, self.last_commit_time = max(self.last_committed, step), time.time()

    def status(self) -> dict[str, Any]:
        """For the keeper's status file: the workers' at-risk policy, the agent, ``/metrics``, ``stalwart ckpt``."""
        return {
            "url": self.url,
            "ok": self.streak == 0,
            "cause": self.cause if self.streak else None,
            "last_error": self.last_error if self.streak else None,
            "failures": self.failures,
            "streak": self.streak,
            "failing_since": self.failing_since,
            "last_committed": self.last_committed,
            "last_commit_time": self.last_commit_time,
        }

    def _journal(self, step: int | None, detail: dict[str, Any]) -> None:
        if self.incidents is None:
            return
        record = {
            "kind": "storage",
            "class": "storage",
            "time": time.time(),
            "step": step,
            "rank": None,
            "detail": {**detail, "url": self.url, "last_committed": self.last_committed},
        }
        try:
            with open(self.incidents, "a") as f:
                f.write(json.dumps(record) + "\n")
            os.chmod(self.incidents, 0o600)
        except OSError as err:  # shm itself full: the log line above still tells
            log.warning("could not record the storage incident in %s: %s", self.incidents, err)


worker_log = logging.getLogger("stalwart.checkpoint")  # a worker's lines (StorageNews)
FINAL_ATTEMPTS = 3  # failed attempts at the final step before the job gives up (with backoff: ~7 s)


class StorageUnavailableError(RuntimeError):
    """Training state that must be durable is not, because the checkpoint store fails."""


@dataclass(frozen=True)
class AtRiskPolicy:
    """``0`` turns a bound off. Both apply only while the keeper reports failing storage: a long
    persist interval on healthy storage is the user's choice, not a fault."""

    max_steps: int = 0
    max_s: float = 1800.0

    def violation(self, storage: dict[str, Any] | None, step: int, now: float, since: float) -> str | None:
        """Why training must stop now (None: go on). ``storage`` is the keeper's storage status;
        ``since`` is when this worker started, the reference when nothing was ever committed."""
        if not storage or storage.get("ok", True):
            return None
        committed = int(storage.get("last_committed", -1))
        steps = step - max(committed, 0)
        seconds = now - (storage.get("last_commit_time") or since)
        if self.max_steps and steps > self.max_steps:
            return f"{steps} steps are only in memory (checkpoint.max_unpersisted_steps={self.max_steps})"
        if self.max_s and seconds > self.max_s:
            return f"{seconds:.0f} s of training are only in memory (checkpoint.max_unpersisted_s={self.max_s:g})"
        return None


def not_durable(step: int, root: Path, storage: dict[str, Any] | None, why: str) -> StorageUnavailableError:
    """The error that ends a job whose state is not durable, saying where the state is and what to run."""
    s = storage or {}
    cause = f"storage {s.get('cause') or 'error'}: {s.get('last_error') or 'no commit'}"
    committed = s.get("last_committed", -1)
    return StorageUnavailableError(
        f"{why}; step {step} is not in durable storage ({cause}; {s.get('url', '')}; last committed step: "
        f"{committed if committed is not None and committed >= 0 else 'none'}). The newest state is kept in "
        f"shared memory at {root}: once storage works again, persist it with "
        f"`stalwart ckpt persist-from-memory {root}` (or `--to URL` for other storage) before this machine "
        "reboots. Not restarting: a restart cannot fix storage."
    )


class StorageNews:
    """Says on the worker's console when persists start failing (once per cause) and when they recover;
    fed the keeper's storage status. Off under an agent, which prints the keeper's incidents itself."""

    def __init__(self, url: str, enabled: bool) -> None:
        self.url, self.enabled = url, enabled
        self.told: str | None = None  # the cause last reported, None while storage works

    def tell(self, status: dict[str, Any] | None) -> None:
        cause = None if not status or status.get("ok", True) else status.get("cause")
        if not self.enabled or cause == self.told:
            return
        assert status is not None or cause is None
        if cause is not None:
            worker_log.error(
                "storage %s: persists to %s fail (%s); training continues from memory (last committed step: %s)",
                cause,
                self.url,
                status.get("last_error") if status else None,
                status.get("last_committed") if status else None,
            )
        elif status is not None:
            worker_log.warning("storage recovered: step %s committed to %s", status.get("last_committed"), self.url)
        self.told = cause
