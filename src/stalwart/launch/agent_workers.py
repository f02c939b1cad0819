"""The agent's view of the worker processes TorchElastic started for it: their pids (the real workers
behind a warm start's stand-ins, ``launch.zygote``), whether one still runs, the log tails of failed
ranks, and their Python stacks before a SIGKILL. Read-only toward TorchElastic: it names its process
context through ``stalwart._compat``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from stalwart import _compat
from stalwart.launch import evidence


class WorkerProcesses:
    def __init__(self, agent: Any, worker_pid: Callable[[int], int]) -> None:
        self.agent = agent  # the LocalElasticAgent whose process context this reads
        self.worker_pid = worker_pid  # the real worker behind a pid (a warm start's stand-in: the fork)

    def _started(self) -> dict[int, int]:
        """Local rank → pid TorchElastic started (a stand-in under a warm start); empty before the first start."""
        pcontext = _compat.worker_processes(self.agent)
        return dict(pcontext.pids()) if pcontext is not None else {}

    def pids(self) -> list[int]:
        """The running workers' real pids (what a throttle stops and continues)."""
        return [self.worker_pid(p) for p in self._started().values()]

    def all_warm(self) -> bool:
        """Every rank of this start was forked warm by the zygote."""
        started = self._started().values()
        return bool(started) and all(self.worker_pid(pid) != pid for pid in started)

    def running(self, rank: int) -> bool:
        """Whether the worker of global ``rank`` still runs."""
        local = {w.global_rank: w.local_rank for w in self.agent.get_worker_group().workers}.get(rank)
        pid = self._started().get(local) if local is not None else None
        return pid is not None and evidence.process_running(self.worker_pid(pid))

    def failure_logs(self, group: WorkerGroup, result: RunResult) -> dict[int, str]:
        """Each failed rank's stderr tail: the evidence the log rules classify."""
        local_of = {w.global_rank: w.local_rank for w in group.workers}
        pcontext = _compat.worker_processes(self.agent)
        stderrs = pcontext.stderrs if pcontext is not None else {}
        return {rank: evidence.log_tail(stderrs.get(local_of[rank])) for rank in result.failures}

    def dump_and_kill(self, group: WorkerGroup, ranks: list[int] | None = None) -> dict[int, str]:
        """Python stacks of the group's workers (or of ``ranks`` only), then SIGKILL them."""
        of = {w.local_rank: w.global_rank for w in group.workers if ranks is None or w.global_rank in ranks}
        started = {local: pid for local, pid in self._started().items() if local in of}
        return evidence.dump_stacks_and_kill(of, started, self.worker_pid)
