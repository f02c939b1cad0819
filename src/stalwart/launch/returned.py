"""Ranks whose script returned: finished, not hung — and ended if their process will not end.

A worker marks its progress record "returned" once its script returned with exit code 0
(``runtime.lifetime``); it then ends itself within ``--exit-grace`` even if a thread of the user's never
stops. This is the agent's backstop for a process that cannot (stopped, or a thread holding the GIL in C):
once every local rank has returned and one is still there ``MARGIN_S`` after its grace, the agent dumps
its stacks and kills it, and the job counts as finished — its training is never redone.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from stalwart.launch.progress import Progress
from stalwart.runtime import sigterm
from stalwart.runtime.lifetime import WATCHDOG_THREAD

log = logging.getLogger("stalwart.agent")
MARGIN_S = 5.0  # after the worker's own grace: its watchdog speaks first


def user_threads(dump: str) -> list[str]:
    """The threads named in a py-spy dump, less the main thread and stalwart's own daemon threads (the exit
    watchdog, a Checkpointer's SIGTERM thread)."""
    names = re.findall(r'^Thread [^\n]*?: "([^"]*)"$', dump, flags=re.MULTILINE)
    return [n for n in names if n not in ("MainThread", WATCHDOG_THREAD, sigterm.THREAD)]


@dataclass
class ReturnedRanks:
    grace_s: float
    ended: set[int] = field(default_factory=set)  # global ranks the agent ended after they returned
    finishing: bool = False  # a local rank reports no more steps: no membership-change restart now

    def observe(self, progress: list[Progress]) -> None:
        self.finishing = any(p.phase in ("done", "returned") for p in progress)

    def overdue(self, progress: list[Progress], now: float, running: Callable[[int], bool]) -> list[int]:
        """Ranks to end: every local rank returned or gone (none is still working, e.g. persisting its
        final state), and these, still ``running``, have been ending for longer than the grace."""
        if not any(p.phase == "returned" for p in progress):  # every tick while training: no /proc reads
            return []
        if any(p.phase != "returned" and running(p.rank) for p in progress):
            return []
        late = now - self.grace_s - MARGIN_S
        return [
            p.rank
            for p in progress
            if p.phase == "returned" and p.rank not in self.ended and p.time < late and running(p.rank)
        ]

    def note_ended(self, ranks: list[int], stacks: dict[int, str]) -> None:
        self.ended.update(ranks)
        for rank in ranks:
            names = ", ".join(repr(n) for n in user_threads(stacks.get(rank, ""))) or "unknown (no stack dump)"
            print(
                f"stalwart: rank {rank} returned from its script more than {self.grace_s + MARGIN_S:g} s ago but "
                f"its process did not end (thread(s) {names}: stacks above); ended it. The job's work is done: "
                f"it counts as finished, nothing is redone.",
                file=sys.stderr,
                flush=True,
            )
        log.warning("ended rank(s) %s stuck after their script returned", ranks)

    def absorb(self, result: RunResult, progress: list[Progress]) -> RunResult:
        """A group whose only failures are ranks that had returned has succeeded: those the agent ended
        here, and those killed by a signal on their way out (a teardown crash after the script's work,
        e.g. an abort in torch's C++ at a cold-started worker's finalization). An exit code of the
        script's own stays a failure."""
        returned = {p.rank for p in progress if p.phase == "returned"}
        finished = self.ended | {r for r, f in result.failures.items() if r in returned and f.exitcode < 0}
        if result.state == WorkerState.FAILED and result.failures and set(result.failures) <= finished:
            for rank in sorted(set(result.failures) - self.ended):
                print(
                    f"stalwart: rank {rank} died (exit {result.failures[rank].exitcode}) after its script "
                    "returned: its work is done, the job counts as finished",
                    file=sys.stderr,
                    flush=True,
                )
            return RunResult(state=WorkerState.SUCCEEDED, return_values=dict.fromkeys(p.rank for p in progress))
        return result

    def reset(self) -> None:
        self.ended.clear()
