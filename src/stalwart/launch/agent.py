"""The node agent: TorchElastic's LocalElasticAgent plus detection, diagnosis and a journal.

TorchElastic keeps doing what it does well (c10d rendezvous, process management, error files).
On top, each monitor tick:
  - reads every local rank's progress record (shared memory, see ``progress``) and declares a hang
    when a rank is silent past its phase-aware allowance, dumping Python stacks with py-spy;
  - on a worker failure, classifies it from the worker's log (``health.log_rules``): user errors fail
    fast with their traceback, everything else asks the master for one restart from the job-wide
    budget (pytorch#108158: TorchElastic counts restarts per node);
  - journals each incident with timestamps: fault, detected, workers stopped, restarted, first step;
  - forwards the incidents workers record themselves (``rank*.incidents.jsonl``: rollbacks, silent
    data corruption) to the master's journal.
A heartbeat thread sends progress and node info to the master once a second and brings back faults
injected with ``stalwart chaos``, which it appends to the chaos file the workers watch, and the
master's eviction: an evicted node stops its workers and leaves (``NodeEvicted``); the others regroup,
with a waiting spare if there is one (see ``eviction``). With a precheck configured, the agent burns
in its devices before every rendezvous (``health.precheck``) and leaves if the master does not admit it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs

from stalwart.health.log_rules import NEVER, Diagnosis, diagnose, last_traceback
from stalwart.health.precheck import PrecheckConfig, run_precheck
from stalwart.health.throttle import Throttle
from stalwart.launch.client import MasterClient, MasterError
from stalwart.launch.hang import HangDetector, HangPolicy
from stalwart.launch.progress import ENV_DIR, Progress, ProgressReader
from stalwart.launch.zygote import Zygote

log = logging.getLogger("stalwart.agent")
LOG_TAIL_BYTES = 256 << 10
ENV_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # stalwart run sets it: a fresh store per round


class NodeEvicted(RuntimeError):
    """This node must leave the job (the master evicted it, or its precheck failed): its agent stops
    the workers and exits without closing the rendezvous, so the other nodes regroup without it."""


@dataclass
class Incident:
    """One fault being handled; times are wall-clock seconds."""

    kind: str
    cls: str
    retry: bool
    detected: float
    fault: float | None = None
    ranks: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
    last_step: int = -1


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stack_dump(pid: int, timeout_s: float = 10.0) -> str:
    """Python stacks of a process via py-spy (spinning or stopped: py-spy finds no threads in a
    SIGSTOPped process forked from a threaded one — a warm-started worker — so it is continued
    first; it is killed right after the dump anyway)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return "(py-spy is not installed: no stack dump)"
    if _stopped(pid):
        os.kill(pid, signal.SIGCONT)
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"(py-spy dump of pid {pid} timed out)"
    return out.stdout or out.stderr


class IncidentTail:
    """Reads the JSON lines workers append to ``rank*.incidents.jsonl``, each line once: remembers
    the offset per file and leaves a partial last line (a write in progress) for the next read."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}

    def read(self, directory: Path) -> list[dict[str, Any]]:
        records = []
        for path in sorted(directory.glob("rank*.incidents.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]
            self._offsets[path] = offset + len(complete)
            for line in complete.splitlines():
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    log.warning("skipping a malformed line in %s: %r", path, line[:200])
                    continue
                if isinstance(record, dict) and isinstance(record.get("kind"), str):
                    records.append(record)
        return records

    def reset(self) -> None:
        self._offsets.clear()


def _tail(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


class StalwartAgent(LocalElasticAgent):
    def __init__(self, spec: WorkerSpec, logs_specs: LogsSpecs, *, master: MasterClient, node_id: str,
                 run_dir: Path, hang_policy: HangPolicy, start_method: str = "spawn",
                 on_failure: Callable[[Incident | None], dict[str, Any]] | None = None,
                 heartbeat_s: float = 1.0, shutdown_timeout: int = 5, window_s: float = 5.0,
                 chaos_file: Path | None = None, precheck: PrecheckConfig | None = None,
                 slowdown: float | None = None, join_info: dict[str, Any] | None = None,
                 zygote: Zygote | None = None) -> None:
        super().__init__(spec, logs_specs, start_method, shutdown_timeout=shutdown_timeout)
        self.master, self.node_id = master, node_id
        self.run_dir = Path(run_dir)
        self.progress_dir = self.run_dir / "progress" / node_id
        self.reader = ProgressReader(self.progress_dir)
        self.hang = HangDetector(hang_policy)
        self.on_failure = on_failure
        self.heartbeat_s = heartbeat_s
        self.window_s = window_s
        self._window: dict[int, list[float]] = {}  # rank → compute seconds of steps in this window
        self._window_start = time.monotonic()
        self._seen_reports: dict[int, int] = {}
        self.incidents: list[Incident] = []
        self._pending: Incident | None = None  # set when detected, completed after the first step
        self._latest: list[Progress] = []
        self._started_at = time.time()
        self._restart_round = 0  # same on every agent of a job: they restart together
        self._progressed = False  # any step completed in any attempt (user-error rules need it)
        self.chaos_file = chaos_file  # faults from `stalwart chaos`, read by the workers each step
        self._chaos_seen = 0  # id of the last injected fault applied to chaos_file
        self.worker_incidents = IncidentTail()
        self.precheck = precheck  # None: no node check before rendezvous
        self.prechecks: list[dict[str, Any]] = []  # every precheck's result, for the run summary
        self.join_info = join_info or {}
        self.zygote = zygote  # warm start: workers are forked by it, TorchElastic sees stand-ins
        self.worker_pid = zygote.worker_pid if zygote else (lambda pid: pid)  # the real worker behind a pid
        self._member = False  # this node's workers are in the current rendezvous round (else: a spare)
        self._leave: str | None = None  # set when the master evicts this node
        # chaos slow:at=node: a straggler on demand (stops and continues the workers, see health.throttle)
        self.throttle = Throttle(self._worker_pids, slowdown) if slowdown else None
        self._worker_store: TCPStore | None = None  # this round's worker store, on group rank 0's node
        self._stop_beats = threading.Event()
        self._beats = threading.Thread(target=self._heartbeat_loop, name="stalwart-heartbeat", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self, role: str = "default") -> RunResult:
        """TorchElastic's run; None when the rendezvous closed while this node waited as a spare."""
        self.master.join(self.node_id, socket.gethostname(), self._worker_group.spec.local_world_size,
                         {"pid": os.getpid(), **self.join_info})
        self._beats.start()
        if self.throttle is not None:
            self.throttle.start()
        try:
            return super().run(role)
        finally:
            if self.throttle is not None:
                self.throttle.close()
            self._stop_beats.set()
            self._beats.join(5)
            self.reader.close()
            self._worker_store = None

    def _worker_pids(self) -> list[int]:
        return [self.worker_pid(p) for p in self._pcontext.pids().values()] if self._pcontext is not None else []

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """Before every rendezvous (first start and restarts): leave if evicted, else precheck."""
        self._member = False
        self._check_evicted()
        if self.precheck is not None:
            self._run_precheck()
        super()._initialize_workers(worker_group)
        self._member = True

    def _check_evicted(self) -> None:
        if self._leave is not None:
            raise NodeEvicted(self._leave)

    def _run_precheck(self) -> None:
        """Burn in this node's devices; the master judges (it also compares nodes) and journals. A node
        it does not admit leaves before joining the round; without a master, the local verdict holds."""
        result = run_precheck(self._worker_group.spec.local_world_size, self.precheck)
        self.prechecks.append(result.to_json())
        log.info("precheck: %s in %.2f s (matmul %.2f ms)%s", "ok" if result.ok else "FAILED", result.seconds,
                 result.matmul_s * 1e3, f": {'; '.join(result.reasons)}" if result.reasons else "")
        try:
            verdict = self.master.call("POST", "/v1/nodes/precheck", {"node_id": self.node_id, **result.to_json()})
        except (MasterError, OSError) as err:
            log.error("no precheck verdict from the master (%s); judging locally", err)
            verdict = {"admit": result.ok, "reason": f"precheck failed: {'; '.join(result.reasons)}"}
        if not verdict.get("admit", result.ok):
            self._leave = str(verdict.get("reason") or "the master did not admit this node after its precheck")
            self._check_evicted()

    def leave_rendezvous(self) -> None:
        """Leave the current round at once, so the others need not wait for this node's rendezvous
        keep-alive to expire (TorchElastic has no public call for one node leaving; best effort)."""
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        handler = self._worker_group.spec.rdzv_handler
        try:
            handler._stop_heartbeats()  # type: ignore[attr-defined]
            handler._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + 10)  # type: ignore[attr-defined]
        except Exception as err:  # an older or newer torch: the keep-alive expiry still removes us
            log.warning("could not leave the rendezvous round (%s: %s); the others wait for our keep-alive to "
                        "expire", type(err).__name__, err)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        if self.throttle is not None:
            self.throttle.pause()  # a stopped process would not act on SIGTERM
        super()._stop_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        if self.throttle is not None:
            self.throttle.pause()
        super()._shutdown(*args, **kwargs)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # Fresh records: a restarted rank must not look alive through its predecessor's record.
        if self.progress_dir.exists():
            if self._pcontext is not None:  # the last words of this agent's previous attempt
                self._forward_worker_incidents()
            shutil.rmtree(self.progress_dir)
        self.worker_incidents.reset()
        self._seen_reports.clear()
        self.progress_dir.mkdir(parents=True)
        self.reader.close()
        os.environ[ENV_DIR] = str(self.progress_dir)  # inherited by the workers
        if self.zygote is not None:
            self.zygote.ensure()  # a zygote that exited (stale code) is replaced for this start
        self._started_at = time.time()
        if self._serve_worker_store(worker_group):
            # TorchElastic tells workers to use the agent's store when the rendezvous shares its own;
            # ours is fresh per round, so the flag is raised for this call only.
            os.environ[ENV_NO_SHARED_STORE] = "0"
            try:
                started = super()._start_workers(worker_group)
            finally:
                os.environ[ENV_NO_SHARED_STORE] = "1"
        else:
            started = super()._start_workers(worker_group)
        if self.throttle is not None:
            self.throttle.resume()
        return started

    def _serve_worker_store(self, worker_group: WorkerGroup) -> bool:
        """Host this round's worker store (the TCPStore of the workers' process group) on the node of
        group rank 0, before any worker starts. Otherwise rank 0 hosts it, and restarted ranks that
        start together race it: a client that connects first backs off for up to ~0.7 s, the largest
        share of a warm restart. A new store per round: torch's shared store keeps the previous
        round's keys (see run.py). False where torch shares its rendezvous store (the user's choice)."""
        if os.environ.get(ENV_NO_SHARED_STORE) != "1":
            return False
        self._worker_store = None  # the previous round's server stops with it
        if worker_group.group_rank == 0:
            try:
                self._worker_store = TCPStore(host_name=worker_group.master_addr, port=worker_group.master_port,
                                              is_master=True, multi_tenant=True, wait_for_workers=False)
            except (RuntimeError, OSError) as err:  # the free port was taken meanwhile: rank 0 hosts it,
                log.warning("could not host the worker store on port %s (%s); rank 0 hosts it",  # clients
                            worker_group.master_port, err)  # elsewhere connect to it the same way
                return False
        return True

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        incident = self._pending
        self._stop_workers(worker_group)
        stopped = time.time()
        saved: dict[str, Any] = {}
        # A fault: persist the newest snapshot. A membership change (a node joins): the same, and the
        # new world resumes from it: the job grows at a checkpoint boundary made now (only a step whose
        # snapshot was in flight is redone).
        if self.on_failure is not None:
            try:
                saved = self.on_failure(incident)
            except Exception as err:  # a failed save must not stop the recovery
                log.exception("save-on-failure failed")
                saved = {"error": f"{type(err).__name__}: {err}"}
        worker_group.state = WorkerState.STOPPED
        self._restart_round += 1
        self.hang.reset()
        self._initialize_workers(worker_group)
        restarted = time.time()
        if incident is not None and incident.id is not None:
            self._journal(lambda: self.master.update_incident(
                incident.id, {"stopped": stopped, "restarted": restarted},
                {"save_on_failure": saved} if saved else None))
        elif incident is None:
            self._journal(lambda: self.master.decide("regroup", "membership changed: workers restarted "
                                                     "without a fault", {"node_id": self.node_id,
                                                                         "save_on_failure": saved}))

    # -- detection ------------------------------------------------------------------------------
    def _progress(self, worker_group: WorkerGroup) -> list[Progress]:
        now = self._started_at
        out = []
        for worker in worker_group.workers:
            p = self.reader.read(worker.global_rank)
            # A rank with no record yet is still starting: it counts from the group's start. So does
            # a record file that exists but was never written (zero-filled: time 0, i.e. 1970 —
            # which read as 55 years of silence once, a false hang at start-up).
            if p is None or p.time <= 0:
                p = Progress(worker.global_rank, -1, now, "init", float("nan"), 0)
            out.append(p)
        return out

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._check_evicted()  # raised out of run(): TorchElastic stops the workers on the way out
        result = super()._monitor_workers(worker_group)
        now = time.time()
        progress = self._progress(worker_group)
        self._latest = progress
        for p in progress:  # collect each new step's compute time for the straggler window
            if p.reports > self._seen_reports.get(p.rank, 0) and p.compute_s == p.compute_s:
                self._window.setdefault(p.rank, []).append(p.compute_s)
            self._seen_reports[p.rank] = p.reports
        self._progressed = self._progressed or any(p.reports > 0 for p in progress)
        self._check_first_step(progress)
        self._forward_worker_incidents()
        if result.state == WorkerState.HEALTHY:
            hung = self.hang.hung(progress, now)
            if hung:
                return self._on_hang(worker_group, hung, progress, now)
        elif result.state == WorkerState.FAILED:
            self._on_exit(worker_group, result, progress, now)
        return result

    def _on_hang(self, worker_group: WorkerGroup, hung: list[tuple[int, float, float]],
                 progress: list[Progress], now: float) -> RunResult:
        ranks = [rank for rank, _, _ in hung]
        log.error("hang: rank(s) %s silent for %s s (allowance %s s); dumping stacks", ranks,
                  [round(s, 1) for _, s, _ in hung], [round(a, 1) for _, _, a in hung])
        started = self._pcontext.pids() if self._pcontext else {}
        pids = {local: self.worker_pid(pid) for local, pid in started.items()}  # the real workers (warm start)
        dumps = {}
        for worker in worker_group.workers:
            pid = pids.get(worker.local_rank)
            if pid:
                dumps[worker.global_rank] = stack_dump(pid)
                print(f"--- stalwart: Python stacks of rank {worker.global_rank} (pid {pid}) ---\n"
                      f"{dumps[worker.global_rank]}", file=sys.stderr, flush=True)
        for pid in {*started.values(), *pids.values()}:  # hung processes may ignore SIGTERM (or be stopped)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        fault = min(p.time for p in progress if p.rank in ranks)
        fault = min([self._fault_time(r) or fault for r in ranks])
        incident = Incident("hang", "system", True, now, fault, ranks,
                            {"silent_s": {r: s for r, s, _ in hung}, "stacks": dumps})
        self._handle(incident, progress)
        return RunResult(state=WorkerState.FAILED)

    def _fault_time(self, rank: int) -> float | None:
        """When chaos injected the fault, if it did (it writes the time first): exact MTTR figures."""
        try:
            return float((self.progress_dir / f"rank{rank}.fault").read_text())
        except (OSError, ValueError):
            return None

    def _on_exit(self, worker_group: WorkerGroup, result: RunResult, progress: list[Progress],
                 now: float) -> None:
        local_of = {w.global_rank: w.local_rank for w in worker_group.workers}
        candidates = []
        for rank, failure in result.failures.items():
            text = _tail(self._pcontext.stderrs.get(local_of[rank]) if self._pcontext else None)
            if failure.exitcode < 0:
                name = signal.Signals(-failure.exitcode).name
                diagnosis = Diagnosis(name.lower(), "system", NEVER, f"killed by {name}")
            else:
                diagnosis = diagnose(text) or Diagnosis("exit", "system", NEVER, f"exit code {failure.exitcode}")
            # Peers of a dead rank fail with connection errors: prefer the failure that is a cause.
            # The agent's own SIGTERM to the survivors is a consequence, too.
            consequential = diagnosis.kind in ("connection", "collective_timeout", "sigterm")
            candidates.append((consequential, failure.timestamp, rank, failure, diagnosis, text))
        consequential, _, rank, failure, diagnosis, text = min(candidates, key=lambda c: c[:3])
        traceback = failure.message if "Traceback" in str(failure.message or "") else last_traceback(text)
        progressed = self._progressed or any(p.reports > 0 for p in progress)
        retry = diagnosis.retry(progressed)
        incident = Incident(diagnosis.kind, diagnosis.cls, retry, now, self._fault_time(rank), [rank],
                            {"exitcode": failure.exitcode, "evidence": diagnosis.evidence,
                             "traceback": traceback, "consequential": consequential})
        if not retry:
            print(f"stalwart: rank {rank} failed with a user error ({diagnosis.kind}); not restarting.\n"
                  f"{traceback or diagnosis.evidence}", file=sys.stderr, flush=True)
        self._handle(incident, progress)

    def _handle(self, incident: Incident, progress: list[Progress]) -> None:
        incident.last_step = max((p.step for p in progress), default=-1)
        incident.details.update(last_step=incident.last_step, ranks=incident.ranks)
        times = {"detected": incident.detected}
        if incident.fault is not None:
            times["fault"] = incident.fault
        self._journal(lambda: setattr(incident, "id", self.master.open_incident(
            incident.kind, self.node_id, incident.cls, times, incident.details)))
        allowed = incident.retry
        if allowed:
            try:
                decision = self.master.request_restart(f"{incident.kind} on rank(s) {incident.ranks}",
                                                       self.node_id, self._restart_round)
                allowed = decision["allowed"]
                if decision.get("leave"):  # evicted for this failure: leave instead of restarting
                    self._leave = decision["leave"]
                if not allowed:
                    print(f"stalwart: restart budget used up ({decision['used']}/{decision['budget']}); "
                          "giving up", file=sys.stderr, flush=True)
            except (MasterError, OSError) as err:
                log.error("master unreachable for the restart decision (%s); using the local budget", err)
        if not allowed:
            self._remaining_restarts = 0
        self.incidents.append(incident)
        self._pending = incident if allowed else None

    def _check_first_step(self, progress: list[Progress]) -> None:
        """Close the pending incident when every rank has reported a step since the restart."""
        incident = self._pending
        if incident is None or not progress or any(p.reports == 0 for p in progress):
            return
        first = max(p.time for p in progress)
        self._pending = None
        pids = self._pcontext.pids().values() if self._pcontext is not None else []
        warm = bool(pids) and all(self.worker_pid(pid) != pid for pid in pids)  # every rank forked warm
        incident.details.update(first_step=first, warm_start=warm)
        if incident.id is not None:
            self._journal(lambda: self.master.update_incident(incident.id, {"first_step": first},
                                                              {"warm_start": warm}))

    def _forward_worker_incidents(self) -> None:
        """Journal what workers reported themselves (see ``stalwart.incident``); an ``sdc`` with
        ``evict`` also journals a decision naming this node (the eviction itself is a later step)."""
        now = time.time()
        for record in self.worker_incidents.read(self.progress_dir):
            kind, detail = record["kind"], record.get("detail") or {}
            if not isinstance(detail, dict):
                detail = {"detail": detail}
            details = {**detail, "rank": record.get("rank"), "step": record.get("step"), "source": "worker"}
            times = {"detected": now}
            if isinstance(record.get("time"), (int, float)):
                times["fault"] = float(record["time"])
            log.warning("worker incident on rank %s at step %s: %s %s", record.get("rank"), record.get("step"),
                        kind, detail)
            self._journal(lambda: self.master.open_incident(kind, self.node_id, record.get("class"), times, details))
            if kind == "sdc" and detail.get("evict"):
                self._journal(lambda: self.master.decide(
                    "evict", f"silent data corruption on rank {record.get('rank')} (node {self.node_id}) at "
                    f"step {record.get('step')}", {"node_id": self.node_id, "rank": record.get("rank"),
                                                    "step": record.get("step")}))

    def _apply_chaos(self, specs: list[dict[str, Any]]) -> None:
        """Append injected faults to the chaos file (replaced atomically: a worker never reads half a
        line); workers re-read it when its mtime changes, and the rank/step keys pick who fires."""
        if not specs or self.chaos_file is None:
            return
        lines = self.chaos_file.read_text() if self.chaos_file.exists() else ""
        lines += "".join(f"{s['spec']}\n" for s in specs)
        self.chaos_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.chaos_file.with_name(self.chaos_file.name + ".tmp")
        tmp.write_text(lines)
        os.replace(tmp, self.chaos_file)
        self._chaos_seen = max(int(s["id"]) for s in specs)
        log.warning("chaos: injected %s", [s["spec"] for s in specs])

    def _close_window(self) -> dict[str, float] | None:
        """Every window_s: the slowest local rank's median compute time per step (None otherwise)."""
        if time.monotonic() - self._window_start < self.window_s:
            return None
        self._window_start = time.monotonic()
        samples, self._window = self._window, {}
        medians = [statistics.median(v) for v in samples.values() if v]
        return {"compute_s": max(medians), "steps": sum(len(v) for v in samples.values())} if medians else None

    # -- master ---------------------------------------------------------------------------------
    def _journal(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except (MasterError, OSError) as err:
            log.error("could not journal to the master: %s", err)

    def _heartbeat_loop(self) -> None:
        while not self._stop_beats.wait(self.heartbeat_s):
            ranks = [{"rank": p.rank, "step": p.step, "phase": p.phase, "age_s": round(time.time() - p.time, 3),
                      "loss": None if p.loss != p.loss else p.loss} for p in self._latest]
            body = {"state": self._worker_group.state.name, "ranks": ranks, "member": self._member}
            window = self._close_window()
            if window is not None:
                body["window"] = window
            beat: dict[str, Any] = {"node_id": self.node_id, "progress": body}
            if self.chaos_file is not None:
                beat["chaos_after"] = self._chaos_seen
            try:
                reply = self.master.call("POST", "/v1/nodes/heartbeat", beat, retry_for_s=0)
                self._apply_chaos(reply.get("chaos") or [])
                if reply.get("leave") and self._leave is None:
                    log.warning("evicted by the master: %s", reply["leave"])
                    self._leave = str(reply["leave"])
            except MasterError as err:
                if err.status == 404:  # a master that lost its journal: join again
                    self._journal(lambda: self.master.join(self.node_id, socket.gethostname(),
                                                           self._worker_group.spec.local_world_size))
            except OSError:
                pass  # the master may be restarting; the next beat tries again
