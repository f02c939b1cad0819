"""The agent's detect → decide steps without processes: records, failures and logs in, incidents out."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from stalwart.launch import detect
from stalwart.launch.client import MasterError
from stalwart.launch.decide import decide, restarts_left
from stalwart.launch.detect import Incident
from stalwart.launch.hang import HangDetector, HangPolicy
from stalwart.launch.heartbeat import ChaosInbox, Heartbeat, NodeStatus
from stalwart.launch.progress import Progress

NO_FAULT = {}.get


@dataclass
class Failure:
    exitcode: int
    timestamp: int
    message: Any = None


def p(
    rank: int, step: int, t: float, reports: int | None = None, phase: str = "step", compute_s: float = float("nan")
) -> Progress:
    return Progress(rank, step, t, phase, 1.0, step + 1 if reports is None else reports, compute_s)


def test_missing_or_unwritten_records_count_from_the_start():
    got = detect.progress_of({0: None, 1: p(1, 4, 0.0), 2: p(2, 4, 99.0)}, started_at=50.0)
    assert [(x.rank, x.step, x.time, x.phase, x.reports) for x in got[:2]] == [
        (0, -1, 50.0, "init", 0),
        (1, -1, 50.0, "init", 0),
    ]
    assert got[2].time == 99.0


def test_hang_names_the_silent_rank_and_its_fault_time():
    detector = HangDetector(HangPolicy(timeout_s=10, warmup_steps=0))
    progress = [p(0, 20, 100.0), p(1, 20, 95.0)]
    assert detect.hang(detector, progress, 104.0, NO_FAULT) is None
    incident = detect.hang(detector, progress, 106.0, NO_FAULT)
    assert incident is not None and (incident.kind, incident.cls, incident.retry) == ("hang", "system", True)
    assert incident.ranks == [1] and incident.fault == 95.0 and incident.last_step == 20
    assert incident.details["silent_s"] == {1: pytest.approx(11.0)} and incident.details["allowance_s"] == {1: 10}
    chaos = detect.hang(detector, progress, 106.0, {1: 96.5}.get)
    assert chaos is not None and chaos.fault == 96.5, "chaos's own fault time is exact"


def test_hang_spares_ranks_in_startup_or_done():
    detector = HangDetector(HangPolicy(timeout_s=1, startup_s=60, warmup_steps=2))
    assert detect.hang(detector, [p(0, -1, 0.0, reports=0, phase="init")], 30.0, NO_FAULT) is None
    assert detect.hang(detector, [p(0, 9, 0.0, phase="done")], 1000.0, NO_FAULT) is None
    assert detect.hang(detector, [p(0, 9, 0.0, phase="returned")], 1000.0, NO_FAULT) is None


def test_returned_ranks_are_ended_only_once_every_rank_returned_and_the_grace_passed():
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from stalwart.launch.returned import MARGIN_S, ReturnedRanks

    ranks = ReturnedRanks(grace_s=10.0)
    late = 100.0 + 10.0 + MARGIN_S + 0.1
    running = {0: True, 1: True}.get
    # rank 1 still works (e.g. persists its final state): nobody is ended, whatever the age
    working = [p(0, 9, 100.0, phase="returned"), p(1, 9, 100.0, phase="done")]
    assert ranks.overdue(working, late, running) == []
    ranks.observe(working)
    assert ranks.finishing, "no membership-change restart of a finished script"
    assert ranks.overdue(working, late, {0: True, 1: False}.get) == [0], "a rank that is gone does not hold it"
    both = [p(0, 9, 100.0, phase="returned"), p(1, 9, 104.0, phase="returned")]
    assert ranks.overdue(both, late - 0.2, running) == []  # within the grace and margin
    assert ranks.overdue(both, late, running) == [0]
    assert ranks.overdue(both, late, {0: False, 1: True}.get) == [], "a rank whose process ended is left alone"
    ranks.note_ended([0], {0: 'Thread 7 (idle): "MainThread"\nThread 8 (active): "user-loader"\n'})
    assert ranks.overdue(both, late, running) == [], "ended once"
    # TorchElastic's view of the kill: a failure of rank 0 only, which is the job finishing
    failed = RunResult(state=WorkerState.FAILED, failures={0: Failure(-signal.SIGKILL, 1)})
    assert ranks.absorb(failed, both).state == WorkerState.SUCCEEDED
    assert ranks.absorb(failed, both).return_values == {0: None, 1: None}
    other = RunResult(state=WorkerState.FAILED, failures={0: Failure(-9, 1), 1: Failure(1, 1)})
    assert ranks.absorb(other, both) is other, "the script's own exit code beside it stays a failure"
    ranks.reset()
    assert ranks.absorb(failed, both).state == WorkerState.SUCCEEDED, "a signal after the return: finished"
    training = [p(0, 9, 100.0), p(1, 9, 100.0)]
    assert ranks.absorb(failed, training) is failed, "a signal while training is a fault"
    ranks.observe(training)
    assert not ranks.finishing


def test_the_threads_still_running_are_named_from_the_stack_dump():
    from stalwart.launch.returned import user_threads

    dump = (
        'Process 5 "python x.py"\nThread 0x1 (idle): "MainThread"\n    _shutdown (threading.py:1590)\n'
        'Thread 0x2 (active+gil): "user-never-ends"\n    hog (x.py:3)\nThread 0x3 (idle): "stalwart-exit-watchdog"\n'
        'Thread 0x4 (idle): "stalwart-sigterm"\n    _watch (stalwart/runtime/sigterm.py:131)\n'
    )
    assert user_threads(dump) == ["user-never-ends"]


def test_worker_exit_prefers_the_cause_over_its_consequences():
    progress = [p(0, 5, 1.0), p(1, 5, 1.0)]
    failures = {0: Failure(1, 10), 1: Failure(-signal.SIGKILL, 12)}
    logs = {0: "RuntimeError: Connection reset by peer\n", 1: ""}
    incident = detect.worker_exit(failures, logs, progress, False, 20.0, {1: 11.5}.get)
    assert (incident.kind, incident.ranks, incident.retry, incident.fault) == ("sigkill", [1], True, 11.5)
    assert incident.details["consequential"] is False and incident.details["exitcode"] == -signal.SIGKILL
    assert incident.last_step == 5


def test_worker_exit_user_errors_fail_fast_depending_on_progress():
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad batch size\n'
    before = detect.worker_exit({0: Failure(1, 3)}, {0: tb}, [p(0, -1, 0.0, reports=0)], False, 5.0, NO_FAULT)
    assert (before.kind, before.cls, before.retry) == ("type_error", "user", False)
    assert "ValueError: bad batch size" in before.details["traceback"]
    after = detect.worker_exit({0: Failure(1, 3)}, {0: tb}, [p(0, -1, 0.0, reports=0)], True, 5.0, NO_FAULT)
    assert after.retry, "the same error after steps completed may be transient: restart"
    syntax = detect.worker_exit({0: Failure(1, 3)}, {0: "SyntaxError: invalid\n"}, [p(0, 3, 1.0)], True, 5.0, NO_FAULT)
    assert not syntax.retry
    plain = detect.worker_exit({0: Failure(7, 3)}, {}, [p(0, 3, 1.0)], True, 5.0, NO_FAULT)
    assert (plain.kind, plain.retry, plain.details["evidence"]) == ("exit", True, "exit code 7")


def test_first_step_waits_for_every_rank():
    assert detect.first_step([p(0, 3, 10.0), p(1, -1, 0.0, reports=0)]) is None
    assert detect.first_step([p(0, 3, 10.0), p(1, 3, 12.0)]) == 12.0
    assert detect.first_step([]) is None


def test_worker_reports_become_journal_entries():
    sdc = detect.worker_report(
        {"kind": "sdc", "class": "hardware", "rank": 1, "step": 7, "time": 5, "detail": {"evict": True}}, "n1", 9.0
    )
    assert sdc.times == {"detected": 9.0, "fault": 5.0} and sdc.details["source"] == "worker"
    assert sdc.evict_reason == "silent data corruption on rank 1 (node n1) at step 7"
    rollback = detect.worker_report({"kind": "rollback", "detail": "to step 3"}, "n1", 9.0)
    assert rollback.details["detail"] == "to step 3" and rollback.evict_reason is None
    assert rollback.times == {"detected": 9.0}


def incident(retry: bool = True) -> Incident:
    return Incident("sigkill", "system", retry, 1.0, ranks=[0])


def test_decide_asks_the_master_for_the_job_budget():
    assert decide(incident(), lambda: {"allowed": True}, 0).restart
    denied = decide(incident(), lambda: {"allowed": False, "used": 2, "budget": 2}, 5)
    assert not denied.restart and denied.reason == "restart budget used up (2/2)"
    evicted = decide(incident(), lambda: {"allowed": True, "leave": "caused 3 failures"}, 5)
    assert evicted.restart and evicted.leave == "caused 3 failures"


def test_decide_fails_user_errors_fast_and_falls_back_to_the_local_budget():
    asked = []
    assert not decide(incident(retry=False), lambda: asked.append(1) or {"allowed": True}, 5).restart
    assert asked == [], "a user error does not spend the budget"

    def unreachable() -> dict:
        raise MasterError(503, "down")

    assert decide(incident(), unreachable, 1).restart
    assert not decide(incident(), unreachable, 0).restart
    assert restarts_left(3, 5) == 0 and restarts_left(3, 1) == 2


def test_node_status_windows_and_eviction():
    clock = [0.0]
    status = NodeStatus(window_s=5.0, clock=lambda: clock[0])
    status.observe([p(0, 1, 1.0, compute_s=0.2), p(1, 1, 1.0, compute_s=0.4)])
    status.observe([p(0, 1, 1.0, compute_s=0.2), p(1, 2, 2.0, compute_s=0.6)])  # rank 0: no new step
    body = status.report(3.0)
    assert "window" not in body and [r["step"] for r in body["ranks"]] == [1, 2]
    assert body["member"] is None, "not at the rendezvous yet: neither member nor spare"
    status.set_member(False)
    assert status.report(3.0)["member"] is False and status.report(3.0)["round"] is None
    status.set_member(True, 3)
    status.set_member(False)  # regrouping: it still names the round it was in
    assert (status.report(3.0)["member"], status.report(3.0)["round"]) == (False, 3)
    clock[0] = 6.0
    # rank 1 reported steps 1 and 2 one second apart: the step time; rank 0 reported one step only
    assert status.report(3.0)["window"] == {"compute_s": 0.5, "steps": 3, "step_s": 1.0}
    assert "window" not in status.report(3.0), "the window restarts"
    assert status.evict("slow") and not status.evict("again") and status.leave == "slow"


def test_node_status_loses_no_step_between_threads():
    """The heartbeat closes windows while the monitor adds steps: every step lands in exactly one window."""
    import sys

    status = NodeStatus(window_s=0.0)
    stop = threading.Event()
    counted: list[int] = []

    def beat() -> None:
        while not stop.is_set():
            counted.append(status.report(1.0).get("window", {}).get("steps", 0))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        thread = threading.Thread(target=beat)
        thread.start()
        steps = 3000
        for i in range(1, steps + 1):
            status.observe([p(r, i, 1.0, reports=i, compute_s=0.1) for r in range(8)])
        stop.set()
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    counted.append(status.report(1.0).get("window", {}).get("steps", 0))
    assert sum(counted) == steps * 8


class FakeMaster:
    def __init__(self, reply: dict | Exception) -> None:
        self.reply, self.beats, self.joins = reply, [], []

    def call(self, method: str, path: str, body: dict, retry_for_s: float = 0) -> dict:
        self.beats.append(body)
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def join(self, *args: Any) -> dict:
        self.joins.append(args)
        return {}


def test_heartbeat_applies_chaos_and_eviction(tmp_path):
    status = NodeStatus()
    master = FakeMaster({"chaos": [{"id": 3, "spec": "kill:rank=1"}], "leave": "evicted: straggler"})
    inbox = ChaosInbox(tmp_path / "chaos" / "injected")
    beat = Heartbeat(master, "n1", status, 2, lambda: "HEALTHY", chaos=inbox)  # type: ignore[arg-type]
    beat.beat()
    assert master.beats[0]["progress"]["state"] == "HEALTHY" and master.beats[0]["chaos_after"] == 0
    assert inbox.path.read_text() == "kill:rank=1\n" and inbox.seen == 3
    assert status.leave == "evicted: straggler"
    lost = FakeMaster(MasterError(404, "unknown node"))
    Heartbeat(lost, "n1", status, 2, lambda: "HEALTHY").beat()  # type: ignore[arg-type]
    assert lost.joins and lost.joins[0][0] == "n1", "a master that lost its journal is joined again"


def test_heartbeat_stop_sends_the_final_state_even_between_periodic_beats():
    from stalwart.launch.progress import Progress

    status = NodeStatus()
    master = FakeMaster({})
    beat = Heartbeat(master, "n1", status, 1, lambda: "SUCCEEDED", interval_s=3600)  # type: ignore[arg-type]
    beat.start()
    status.observe([Progress(rank=0, step=8, time=1.0, phase="step", loss=2.5, reports=8, compute_s=0.1)])
    beat.stop()
    assert len(master.beats) == 1, "no periodic beat came due; stop sent the only one"
    [rank] = master.beats[0]["progress"]["ranks"]
    assert rank["step"] == 8 and master.beats[0]["progress"]["state"] == "SUCCEEDED"
    beat.stop()
    assert len(master.beats) == 1, "a second stop sends nothing"


def test_round_store_handler_tells_workers_which_store_without_touching_the_environment(monkeypatch):
    import copy
    import os

    from torch.distributed.elastic.rendezvous.api import RendezvousHandler

    from stalwart.launch.rendezvous import RoundStoreHandler

    class Inner(RendezvousHandler):
        settings = "inner settings"

        def __init__(self) -> None:
            self.closed = False

        @property
        def use_agent_store(self) -> bool:  # torch's: shares its store unless the switch is "1"
            return os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

        def get_backend(self) -> str:
            return "c10d"

        def next_rendezvous(self):
            return "info"  # type: ignore[override]

        def is_closed(self) -> bool:
            return self.closed

        def set_closed(self) -> None:
            self.closed = True

        def num_nodes_waiting(self) -> int:
            return 2

        def get_run_id(self) -> str:
            return "job"

        def shutdown(self) -> bool:
            return True

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handler = RoundStoreHandler(Inner())
    assert not handler.torch_shares_store and not handler.use_agent_store
    handler.agent_hosts_store = True
    assert handler.use_agent_store and os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert (handler.next_rendezvous(), handler.num_nodes_waiting(), handler.get_run_id()) == ("info", 2, "job")
    handler.set_closed()
    assert handler.is_closed() and handler.settings == "inner settings"
    assert copy.copy(handler).inner is handler.inner
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    assert handler.torch_shares_store, "torch's own sharing is the user's choice"


def test_a_new_job_token_is_private_and_always_parses_as_a_flag_value(tmp_path):
    """A URL-safe token starts with '-' one time in 64 and `--job-token -x…` is then an option: the demo
    failed that way in CI. New tokens are hex; a created token file is private to its user."""
    import stat

    from stalwart.launch.master import load_or_create_token
    from stalwart.launch.run import build_parser

    tokens = [load_or_create_token(tmp_path / f"t{i}" / "token") for i in range(300)]
    assert len(set(tokens)) == 300 and all(len(t) >= 32 for t in tokens)
    for token in tokens:
        args, _ = build_parser().parse_known_args(["--job-token", token, "train.py"])
        assert args.job_token == token
    assert stat.S_IMODE((tmp_path / "t0" / "token").stat().st_mode) == 0o600


def test_a_master_bound_to_every_interface_advertises_a_dialable_address(tmp_path):
    import socket

    from stalwart.launch.master import Master

    master = Master(tmp_path / "journal.sqlite", "token", host="0.0.0.0", port=0, rdzv_port=0)
    try:
        assert master.address.startswith(f"http://{socket.gethostname()}:")
        assert master.state.rdzv_endpoint.startswith(f"{socket.gethostname()}:")
    finally:
        master.stop()


def test_heartbeats_scale_with_the_job_jitter_and_back_off():
    from stalwart.launch.master_state import heartbeat_interval

    assert [heartbeat_interval(n) for n in (1, 1000, 2048, 10_000, 100_000)] == [1.0, 1.0, 2.048, 10.0, 10.0]
    import tempfile
    from pathlib import Path

    from stalwart.launch.journal import Journal
    from stalwart.launch.master_state import MasterState

    with tempfile.TemporaryDirectory() as tmp:
        state = MasterState(Journal(Path(tmp) / "j.sqlite"), "job", 1, 30.0)
        for i in range(1500):
            state.journal.join(f"n{i}", "h", 1, {})

        def every_row() -> list:
            raise AssertionError("a join must not decode every node (2,000 joins × 2,000 rows stalled the master)")

        state.journal.nodes = every_row  # type: ignore[method-assign]
        assert state.join({"node_id": "late", "host": "h", "nproc": 1})["heartbeat_s"] == 1.501
    down = FakeMaster(OSError("connection refused"))
    beat = Heartbeat(down, "n1", NodeStatus(), 1, lambda: "HEALTHY", interval_s=2.0)  # type: ignore[arg-type]
    waits = [beat.next_wait() for _ in range(200)]
    assert 1.8 <= min(waits) < max(waits) <= 2.2, "±10 % jitter around the interval"
    for missed in range(1, 6):
        beat.beat()
        assert 0.9 * min(2.0 * 2**missed, 30.0) <= beat.next_wait() <= 1.1 * min(2.0 * 2**missed, 30.0)
    beat.master = FakeMaster({})
    beat.beat()
    assert beat.next_wait() <= 2.2, "an answered beat ends the backoff"


def test_a_lost_node_is_seen_with_when_and_why_or_not_at_all(tmp_path):
    """Readers (survivors asking ``/v1/nodes/lost``, status) on another connection must never see a
    node lost without its ``lost_at`` and its decision: after every statement the master's journal
    runs, a second connection checks. A beat newer than the cutoff keeps a node alive."""
    import sqlite3

    from stalwart.launch.journal import Journal
    from stalwart.launch.master_state import MasterState

    journal = Journal(tmp_path / "j.sqlite")
    reader = sqlite3.connect(tmp_path / "j.sqlite")
    seen: list[tuple[str, bool, bool]] = []

    class Watched:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def __getattr__(self, name: str):
            return getattr(self.db, name)

        def execute(self, *args):
            cur = self.db.execute(*args)
            for (node,) in reader.execute("SELECT node_id FROM nodes WHERE state = 'lost'").fetchall():
                when = reader.execute("SELECT 1 FROM job WHERE key = ?", (f"lost_at.{node}",)).fetchone()
                why = reader.execute("SELECT 1 FROM decisions WHERE details LIKE ?", (f'%"{node}"%',)).fetchone()
                seen.append((node, when is not None, why is not None))
            return cur

    journal._db = Watched(journal._db)  # type: ignore[assignment]
    state = MasterState(journal, "job", 1, node_timeout_s=5.0)
    for n in ("n0", "n1", "n2"):
        journal.join(n, "h", 1, {})
    state.started -= 10.0  # up longer than the timeout
    # n0 and n1 went silent 10 s ago, n2 beats now: no sleep whose length load could make too short.
    reader.execute("UPDATE nodes SET last_heartbeat = last_heartbeat - 10 WHERE node_id IN ('n0', 'n1')")
    reader.commit()
    journal.heartbeat("n2", {"step": 1})
    assert state.sweep() == ["n0", "n1"]
    state.presence_lost("n2")
    state.presence_lost("n2")  # already lost: no second decision
    assert seen and all(when and why for _, when, why in seen), seen
    assert {n["node_id"]: n["state"] for n in journal.nodes()} == {"n0": "lost", "n1": "lost", "n2": "lost"}
    assert [d["details"]["node_id"] for d in journal.decisions() if d["action"] == "node_lost"] == ["n0", "n1", "n2"]
    assert all(lost["lost_at"] is not None for lost in state.lost()["lost"])
    assert not journal.mark_lost("n9", time.time(), "unknown node")
    journal.heartbeat("n0", {"step": 2})  # back: a cutoff older than this beat leaves it alive
    assert not journal.mark_lost("n0", time.time(), "stale sweep", silent_since=time.time() - 5)
