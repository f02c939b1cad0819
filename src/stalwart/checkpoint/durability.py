"""How much training may live only in memory, and the error that stops a job when storage fails it.

While the checkpoint store fails, training goes on from memory snapshots (the keeper retries with
backoff). :class:`AtRiskPolicy` bounds that: once more than ``max_steps`` steps or ``max_s`` seconds of
work since the last committed checkpoint exist only in memory *while storage is failing*, the workers
stop with :class:`StorageUnavailableError`. A job also never ends successfully with its final state
only in memory. The error's message says where the state is and how to persist it; the agent
classifies it as a ``storage`` failure and does not restart the workers for it (a restart cannot fix a
full disk, and would resume from memory and end as if all was well).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("stalwart.checkpoint")
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
            log.error(
                "storage %s: persists to %s fail (%s); training continues from memory (last committed step: %s)",
                cause,
                self.url,
                status.get("last_error") if status else None,
                status.get("last_committed") if status else None,
            )
        elif status is not None:
            log.warning("storage recovered: step %s committed to %s", status.get("last_committed"), self.url)
        self.told = cause
