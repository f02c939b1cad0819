"""The node agent: TorchElastic's process management under stalwart's own supervision loop.

TorchElastic keeps doing what it does well (c10d rendezvous, starting and stopping worker processes,
error files). The loop is stalwart's (``_invoke_run``): every monitor tick it
  - detects (``detect``, pure): a hang when a rank's progress record is silent past its phase-aware
    allowance; a worker failure, classified from the worker's log (``health.log_rules``);
  - decides (``decide``): user errors fail fast with their traceback, everything else asks the master
    for one restart from the job-wide budget (pytorch#108158: TorchElastic counts restarts per node);
  - acts: dumps a hung rank's Python stacks (py-spy) and kills it, persists the newest snapshot
    (``on_failure``), restarts the workers, and journals each incident with timestamps: fault,
    detected, workers stopped, restarted, first step;
and forwards the incidents workers record themselves (rollbacks, silent data corruption) to the
master's journal. A heartbeat thread (``heartbeat``) reports progress and brings back injected faults
and the master's eviction: an evicted node stops its workers and leaves (``NodeEvicted``); the others
regroup, with a waiting spare if there is one (see ``eviction``). With a precheck configured, the agent
burns in its devices before every rendezvous (``health.precheck``) and leaves if the master does not
admit it. TorchElastic internals the agent relies on are named in ``stalwart._compat``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs

from stalwart import _compat, runtime
from stalwart.health.precheck import PrecheckConfig
from stalwart.health.throttle import Throttle
from stalwart.launch import admission, detect, evidence, presence
from stalwart.launch.agent_journal import AgentJournal
from stalwart.launch.agent_workers import WorkerProcesses
from stalwart.launch.client import MasterClient
from stalwart.launch.decide import Decision, decide, restarts_left
from stalwart.launch.detect import Incident
from stalwart.launch.exit_watch import ExitWatch
from stalwart.launch.hang import HangDetector, HangPolicy
from stalwart.launch.heartbeat import ChaosInbox, Heartbeat, NodeStatus
from stalwart.launch.preempt import Preemption
from stalwart.launch.progress import Progress, ProgressReader
from stalwart.launch.rendezvous import RoundStoreHandler, serve_worker_store
from stalwart.launch.returned import ReturnedRanks
from stalwart.launch.zygote import Zygote
from stalwart.observe.hangdiag import hang_collectives

__all__ = ["Incident", "NodeEvicted", "StalwartAgent"]
log = logging.getLogger("stalwart.agent")


class NodeEvicted(RuntimeError):
    """This node must leave the job (the master evicted it, or its precheck failed): its agent stops
    the workers and exits without closing the rendezvous, so the other nodes regroup without it."""


class NodeParked(NodeEvicted):
    """The master's autoscaler took this node out (``--autoscale on``): it waits as a parked spare."""


class StalwartAgent(LocalElasticAgent):
    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        master: MasterClient,
        node_id: str,
        run_dir: Path,
        hang_policy: HangPolicy,
        start_method: str = "spawn",
        on_failure: Callable[[Incident | None], dict[str, Any]] | None = None,
        heartbeat_s: float = 1.0,
        shutdown_timeout: int = 5,
        window_s: float = 5.0,
        chaos_file: Path | None = None,
        precheck: PrecheckConfig | None = None,
        throttle: Callable[[Callable[[], list[int]]], Throttle] | None = None,
        join_info: dict[str, Any] | None = None,
        zygote: Zygote | None = None,
        storage_watch: Callable[[], tuple[list[dict[str, Any]], dict[str, Any] | None]] | None = None,
        exit_grace_s: float = runtime.EXIT_GRACE_S,
        local_restarts: int | None = None,
    ) -> None:
        # Before TorchElastic keeps a reference to the handler: ours tells workers which store to use.
        if not isinstance(spec.rdzv_handler, RoundStoreHandler):
            spec.rdzv_handler = RoundStoreHandler(spec.rdzv_handler)
        self._handler: RoundStoreHandler = spec.rdzv_handler
        super().__init__(spec, logs_specs, start_method, **_compat.local_agent_kwargs(shutdown_timeout))
        self.master, self.node_id = master, node_id
        self.journal = AgentJournal(master, node_id)
        self.run_dir = Path(run_dir)
        self.progress_dir = self.run_dir / "progress" / node_id
        self.reader = ProgressReader(self.progress_dir)
        self.exits = ExitWatch()
        self.hang = HangDetector(hang_policy)
        self.returned = ReturnedRanks(exit_grace_s)  # finished ranks whose process would not end
        self.on_failure = on_failure
        self.incidents: list[Incident] = []
        self._pending: Incident | None = None  # set when detected, completed after the first step
        self._started_at = time.time()
        self._restart_round = 0  # same on every agent of a job: they restart together
        self._failure_restarts = 0  # restarts after a fault (membership changes do not count)
        # This node's budget while the master is unreachable (``--max-restarts``): the spec's count is
        # unbounded under `stalwart run`, where the master's job-wide budget decides.
        self._local_restarts = spec.max_restarts if local_restarts is None else local_restarts
        self._progressed = False  # any step completed in any attempt (user-error rules need it)
        self.worker_incidents = evidence.IncidentTail()
        self.storage_watch = storage_watch  # the keeper's storage incidents and status (launch.storage_watch)
        self.precheck = precheck  # None: no node check before rendezvous
        self.prechecks: list[dict[str, Any]] = []  # every precheck's result, for the run summary
        self.join_info = join_info or {}
        self.zygote = zygote  # warm start: workers are forked by it, TorchElastic sees stand-ins
        self.worker_processes = WorkerProcesses(self, zygote.worker_pid if zygote else (lambda pid: pid))
        self.notice: Preemption | None = None  # set by `stalwart run` once armed (launch.preempt)
        # chaos slow:at=node (a straggler on demand) or --share-with: stops and continues the workers
        self.throttle = throttle(self.worker_processes.pids) if throttle else None
        self._worker_store: TCPStore | None = None  # this round's worker store, on group rank 0's node
        self.status = NodeStatus(window_s)  # shared with the heartbeat thread (locked)
        self.heartbeat = Heartbeat(
            master,
            node_id,
            self.status,
            spec.local_world_size,
            lambda: self.get_worker_group().state.name,
            heartbeat_s,
            ChaosInbox(chaos_file) if chaos_file is not None else None,
            hist_dir=self.progress_dir,
            presence=presence.Presence(master.address, master.token, node_id),
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """TorchElastic's run; None when the rendezvous closed while this node waited as a spare."""
        joined = self.master.join(
            self.node_id,
            socket.gethostname(),
            self.get_worker_group().spec.local_world_size,
            {"pid": os.getpid(), "rdzv_node": _compat.rendezvous_node(self._handler), **self.join_info},
        )
        self.heartbeat.interval_s = max(self.heartbeat.interval_s, float(joined.get("heartbeat_s") or 0))
        self.heartbeat.start()
        if self.throttle is not None:
            self.throttle.start()
        try:
            return super().run(role)
        finally:
            if self.throttle is not None:
                self.throttle.close()
            self.heartbeat.stop()
            self.reader.close()
            self._worker_store = None

    def leave_rendezvous(self) -> None:
        """Leave the current round at once, so the others need not wait for this node's rendezvous
        keep-alive to expire (best effort)."""
        try:
            _compat.leave_rendezvous_round(self._handler)
        except Exception as err:  # an older or newer torch: the keep-alive expiry still removes us
            log.warning(
                "could not leave the rendezvous round (%s: %s); the others wait for our keep-alive to expire",
                type(err).__name__,
                err,
            )

    # -- the loop: detect → decide → act ------------------------------------------------------------
    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Replaces TorchElastic's loop: restarts are decided here (the job's budget), not counted down."""
        group = self.get_worker_group()
        self._initialize_workers(group)
        while True:
            assert group.state != WorkerState.INIT, "workers were not started"
            pcontext = _compat.worker_processes(self)  # a tick, or a worker's exit, whichever comes first
            self.exits.wait(pcontext.pids().values() if pcontext else (), group.spec.monitor_interval)
            result, incident = self._detect(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                _compat.exit_barrier(self)
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                if not self._decide(incident).restart:
                    self._stop_workers(group)
                    group.state = WorkerState.FAILED
                    return result
                _compat.count_restart(self)  # the workers' TORCHELASTIC_RESTART_COUNT
                self._failure_restarts += 1
                self._restart(group)
            elif (
                result.state == WorkerState.HEALTHY
                and not self.returned.finishing  # a finished script is not rerun for a joining node
                and group.spec.rdzv_handler.num_nodes_waiting() > 0
            ):
                log.info("nodes are waiting to join: restarting the worker group (membership change)")
                self._restart(group)  # membership changes do not count as restarts
            elif result.state != WorkerState.HEALTHY:
                raise RuntimeError(f"[{role}] worker group in state {result.state.name}")

    def _detect(self, group: WorkerGroup) -> tuple[RunResult, Incident | None]:
        """One tick: TorchElastic's view of the processes plus the progress records; an incident when
        a rank failed or hung (a hung group is killed here and reported as failed)."""
        self._check_evicted()  # raised out of run(): TorchElastic stops the workers on the way out
        result = _compat.poll_workers(self, group)
        now = time.time()
        progress = self._read_progress(group)
        result = self.returned.absorb(result, progress)
        self.returned.observe(progress)
        self.status.observe(progress)
        self._progressed = self._progressed or any(p.reports > 0 for p in progress)
        self._check_first_step(progress)
        self._forward_worker_incidents()
        fault_of = partial(evidence.fault_time, self.progress_dir)
        incident = None
        if result.state == WorkerState.HEALTHY:
            if overdue := self.returned.overdue(progress, now, self.worker_processes.running):
                self.returned.note_ended(overdue, self.worker_processes.dump_and_kill(group, overdue))
            incident = detect.hang(self.hang, detect.unheld(progress, self.throttle), now, fault_of)
            if incident is not None:
                self._kill_hung(group, incident)
                result = RunResult(state=WorkerState.FAILED)
        elif result.state == WorkerState.FAILED:
            if self.notice is not None:  # a worker killed by the preemption notice: Preempted, not a fault
                self.notice.check_workers([f.exitcode for f in result.failures.values()])
            incident = detect.worker_exit(
                result.failures,
                self.worker_processes.failure_logs(group, result),
                progress,
                self._progressed,
                now,
                fault_of,
            )
            if not incident.retry:
                what = "storage failure" if incident.cls == "storage" else f"user error ({incident.kind})"
                print(
                    f"stalwart: rank {incident.ranks[0]} failed with a {what}; not "
                    f"restarting.\n{incident.details['traceback'] or incident.details['evidence']}",
                    file=sys.stderr,
                    flush=True,
                )
        if incident is not None:
            self.journal.opened(incident)
        return result, incident

    def _decide(self, incident: Incident | None) -> Decision:
        if incident is None:  # TorchElastic could not poll the workers (UNHEALTHY): no diagnosis
            left = restarts_left(self.get_worker_group().spec.max_restarts, self._failure_restarts)
            return Decision(left > 0, reason="worker group unhealthy")
        decision = decide(
            incident,
            lambda: self.master.request_restart(
                f"{incident.kind} on rank(s) {incident.ranks}", self.node_id, self._restart_round
            ),
            restarts_left(self._local_restarts, self._failure_restarts),
        )
        if decision.leave is not None:  # evicted for this failure: leave instead of rejoining
            self.status.evict(decision.leave)
        if incident.retry and not decision.restart:
            print(f"stalwart: {decision.reason}; giving up", file=sys.stderr, flush=True)
        self.incidents.append(incident)
        self._pending = incident if decision.restart else None
        return decision

    def _restart(self, group: WorkerGroup) -> None:
        """Stop the workers, persist (fault or membership change), rendezvous again and start them. A
        membership change resumes the new world from the snapshot persisted now: the job grows at a
        checkpoint boundary made now (only a step whose snapshot was in flight is redone)."""
        incident = self._pending
        self._stop_workers(group)
        stopped = time.time()
        # A member node died: out of the rendezvous now, and no save can commit (``presence``)
        saved = presence.after_loss(self.master, self._handler, self._started_at, self.node_id) if incident else {}
        if not saved and self.on_failure is not None:
            try:
                saved = self.on_failure(incident)
            except Exception as err:  # a failed save must not stop the recovery
                log.exception("save-on-failure failed")
                saved = {"error": f"{type(err).__name__}: {err}"}
        group.state = WorkerState.STOPPED
        self._restart_round += 1
        self.hang.reset()
        self.returned.reset()
        self._initialize_workers(group)
        self.journal.restarted(incident, stopped, time.time(), saved)

    # -- TorchElastic hooks (named in _compat.AGENT_OVERRIDES) -----------------------------------------
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """Before every rendezvous (first start and restarts): leave if evicted, else precheck. A node
        in its precheck is no spare yet (it may fail it): only one waiting at the rendezvous is."""
        self.status.set_member(None)
        self._check_evicted()
        if self.precheck is not None:
            self._run_precheck()
        self.status.set_member(False)
        super()._initialize_workers(worker_group)
        self.status.set_member(True, self._handler.round)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # Fresh records: a restarted rank must not look alive through its predecessor's record.
        if self.progress_dir.exists():
            if _compat.worker_processes(self) is not None:  # the last words of this agent's previous attempt
                self._forward_worker_incidents()
            shutil.rmtree(self.progress_dir)
        self.worker_incidents.reset()
        self.status.new_attempt()
        self.progress_dir.mkdir(parents=True)
        self.reader.close()
        os.environ[runtime.ENV_PROGRESS_DIR] = str(self.progress_dir)  # inherited by the workers
        if (round_ := self._handler.round) is not None:  # the execution, for checkpoint coordination
            os.environ[runtime.ENV_EPOCH] = str(round_)
        if self.zygote is not None:
            self.zygote.ensure()  # a zygote that exited (stale code) is replaced for this start
        self._started_at = time.time()
        self._serve_worker_store(worker_group)
        self._check_notice()  # a notice swallowed in the rendezvous: no workers for it
        started = super()._start_workers(worker_group)
        if self.throttle is not None:
            self.throttle.resume()
        return started

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        if self.throttle is not None:
            self.throttle.pause()  # a stopped process would not act on SIGTERM
        super()._stop_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        self.exits.close()
        if self.throttle is not None:
            self.throttle.pause()
        super()._shutdown(*args, **kwargs)

    # -- acting -----------------------------------------------------------------------------------
    def _serve_worker_store(self, worker_group: WorkerGroup) -> None:
        """Host this round's worker store on the node of group rank 0 before any worker starts, and tell
        the workers to connect to it (``rendezvous.RoundStoreHandler``). Not where torch shares its
        rendezvous store (the user's choice), nor when the port was taken meanwhile (rank 0 hosts it)."""
        self._handler.agent_hosts_store = False
        if self._handler.torch_shares_store:
            return
        self._worker_store = None  # the previous round's server stops with it
        if worker_group.group_rank == 0:
            self._worker_store = serve_worker_store(worker_group.master_addr, worker_group.master_port)
            if self._worker_store is None:
                return
        self._handler.agent_hosts_store = True

    def _kill_hung(self, group: WorkerGroup, incident: Incident) -> None:
        """Dump the hung group's Python stacks, then SIGKILL it: hung processes may ignore SIGTERM (or
        be stopped)."""
        silent, allowance = incident.details["silent_s"], incident.details.pop("allowance_s")
        log.error(
            "hang: rank(s) %s silent for %s s (allowance %s s); dumping stacks",
            incident.ranks,
            [round(silent[r], 1) for r in incident.ranks],
            [round(allowance[r], 1) for r in incident.ranks],
        )
        incident.details["collectives"] = collectives = hang_collectives(
            self.progress_dir, [w.global_rank for w in group.workers]
        )
        log.error("hang diagnosis:\n%s", collectives["summary"])
        incident.details["stacks"] = self.worker_processes.dump_and_kill(group)

    def _check_first_step(self, progress: list[Progress]) -> None:
        """Close the pending incident when every rank has reported a step since the restart."""
        incident = self._pending
        first = detect.first_step(progress) if incident is not None else None
        if incident is None or first is None:
            return
        self._pending = None
        self.journal.first_step(incident, first, self.worker_processes.all_warm())

    def _forward_worker_incidents(self) -> None:
        self.journal.worker_reports(self.worker_incidents.read(self.progress_dir))
        if self.storage_watch is not None:
            records, storage = self.storage_watch()
            self.status.set_storage(storage)
            self.journal.worker_reports(records)

    # -- evidence and membership --------------------------------------------------------------------
    def _read_progress(self, group: WorkerGroup) -> list[Progress]:
        return detect.progress_of(
            {w.global_rank: self.reader.read(w.global_rank) for w in group.workers}, self._started_at
        )

    def _check_notice(self) -> None:
        """A preemption notice whose exception an ``except Exception`` swallowed (TorchElastic's log
        tailer while it stops workers, a save-on-failure under way) is acted on now, not when the run
        ends: a restart after it would train on until the scheduler's SIGKILL, its save lost."""
        if self.notice is not None and (missed := self.notice.missed()) is not None:
            raise missed

    def _check_evicted(self) -> None:
        # First a notice swallowed meanwhile (a save-on-failure, a precheck's burn-in): it is no eviction,
        # and a restart's _initialize_workers checks here before it starts new workers for it.
        self._check_notice()
        reason = self.status.leave
        if reason is not None:
            raise NodeParked(reason) if self.status.parked else NodeEvicted(reason)

    def _run_precheck(self) -> None:
        """A node the master does not admit after its precheck leaves before joining the round."""
        assert self.precheck is not None
        local_world = self.get_worker_group().spec.local_world_size
        reason = admission.precheck_refusal(self.master, self.node_id, local_world, self.precheck, self.prechecks)
        if reason is not None:
            self.status.evict(reason)
            self._check_evicted()
