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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
