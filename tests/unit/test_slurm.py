"""Slurm awareness (launch/slurm.py) and the preemption flags (launch/preempt.py): pure parsing."""

from __future__ import annotations

import signal

import pytest

from stalwart.launch import preempt, slurm
from stalwart.launch.run import build_parser


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[1-2],b3,c[9-10]", ["a1", "a2", "b3", "c9", "c10"]),
        ("gpu-[1-2]-ib", ["gpu-1-ib", "gpu-2-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("host.example.com,other", ["host.example.com", "other"]),
    ],
)
def test_expand_hostlist_like_scontrol_show_hostnames(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[a-b]"])
def test_malformed_hostlist_is_a_value_error(bad):
    with pytest.raises(ValueError, match="Slurm host list"):
        slurm.expand_hostlist(bad)


STEP_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_RESTART_COUNT": "2",
}


def test_step_from_environment():
    step = slurm.from_env(STEP_ENV)
    assert step == slurm.SlurmStep(job_id="4242", ntasks=4, task=1, first_host="gpu07", restart_count=2)
    assert not step.hosts_master and slurm.SlurmStep("4242", 4, 0, "gpu07", 0).hosts_master
    assert slurm.PORT_BASE <= step.port < slurm.PORT_BASE + slurm.PORT_SPAN


def test_outside_a_step_nothing_applies():
    assert slurm.from_env({}) is None
    assert slurm.from_env({"SLURM_JOB_ID": "1"}) is None, "the batch shell is not a task of a step"


def parse(*argv: str):
    parser = build_parser()
    return parser, parser.parse_args([*argv, "train.py"])


def test_apply_fills_defaults_from_the_step():
    parser, args = parse()
    slurm.apply(args, parser, slurm.from_env(STEP_ENV), STEP_ENV)
    assert (args.nnodes, args.node_rank, args.rdzv_id, args.rdzv_backend) == ("4", 1, "slurm-4242", "c10d")
    port = slurm.from_env(STEP_ENV).port
    assert args.master == f"http://gpu07:{port}"
    assert slurm.master_address(slurm.from_env(STEP_ENV), {**STEP_ENV, slurm.ENV_PORT: "31000"}) == (
        "http://gpu07:31000"
    )


def test_explicit_flags_win():
    parser, args = parse(
        "--nnodes", "2:4", "--node-rank", "3", "--rdzv-id", "mine", "--master", "http://m:1", "--rdzv-endpoint", "h:5"
    )
    slurm.apply(args, parser, slurm.from_env(STEP_ENV), STEP_ENV)
    assert (args.nnodes, args.node_rank, args.rdzv_id, args.master) == ("2:4", 3, "mine", "http://m:1")
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("static", "h:5")


def test_single_task_keeps_the_local_rendezvous_and_names_the_run_by_job():
    env = {**STEP_ENV, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    parser, args = parse("--nproc-per-node", "2")
    slurm.apply(args, parser, slurm.from_env(env), env)
    assert (args.nnodes, args.master, args.rdzv_id) == ("1:1", None, "slurm-4242")


def test_preempt_signals():
    assert preempt.parse_signals("SIGTERM, usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert preempt.parse_signals("") == ()
    with pytest.raises(ValueError, match="unknown signal"):
        preempt.parse_signals("SIGNOPE")
    with pytest.raises(ValueError, match="cannot be a preemption notice"):
        preempt.parse_signals("KILL")
    assert preempt.torch_signals("SIGTERM,SIGINT,SIGHUP", (signal.SIGTERM, signal.SIGUSR1)) == "SIGINT,SIGHUP"


def test_requeue_outside_slurm_says_why():
    assert preempt.requeue({}) == {"requeued": False, "detail": "not a Slurm job"}


def test_the_notice_raises_once_in_the_agent():
    notice = preempt.Preemption((signal.SIGUSR1,))
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        notice.arm()
        with pytest.raises(preempt.Preempted) as err:
            signal.raise_signal(signal.SIGUSR1)
        assert err.value.signum == signal.SIGUSR1 and err.value.sigval == signal.SIGTERM, "workers get SIGTERM"
        assert notice.received == err.value.received
        signal.raise_signal(signal.SIGUSR1)  # a second notice during the persist is ignored
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_worker_killed_by_the_notice_is_the_preemption_and_a_swallowed_notice_is_not_lost():
    """Slurm signals every process of the step: a cold-started worker may die of SIGUSR1 before the
    agent's handler runs (CI saw it: the job spent its restart budget instead of persisting), and the
    handler's exception can be raised inside a library's ``except Exception`` and lost."""
    notice = preempt.Preemption((signal.SIGTERM, signal.SIGUSR1))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        notice.arm()
        notice.check_workers([1, -int(signal.SIGTERM)])  # a fault, and the agent's own stop signal: not a notice
        assert notice.missed() is None
        with pytest.raises(preempt.Preempted) as err:
            notice.check_workers([0, -int(signal.SIGUSR1)])
        assert err.value.signum == signal.SIGUSR1 and notice.received == err.value.received
        notice.check_workers([-int(signal.SIGUSR1)])  # once
        signal.raise_signal(signal.SIGUSR1)  # disarmed: ignored
        missed = notice.missed()
        assert isinstance(missed, preempt.Preempted) and missed.signum == signal.SIGUSR1

        swallowed = preempt.Preemption((signal.SIGUSR1,))
        swallowed.arm()
        try:
            signal.raise_signal(signal.SIGUSR1)
        except Exception:  # as TorchElastic's log tailer does
            pass
        assert swallowed.missed() is not None and swallowed.missed().signum == signal.SIGUSR1
    finally:  # both: a SIGTERM left ignored here is inherited by every process the later tests start
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_the_agent_acts_on_a_swallowed_notice_at_its_next_tick_not_at_the_end_of_the_run():
    """Swallowed while a restart stopped the workers or saved on failure, the notice used to wait for
    the run to end: the agent started new workers and trained on until the scheduler's SIGKILL."""
    from stalwart.launch.agent import StalwartAgent

    agent = object.__new__(StalwartAgent)  # only its notice matters here
    agent.notice = None
    agent._check_notice()  # not armed (a local run without a notice): nothing to act on
    agent.notice = preempt.Preemption((signal.SIGUSR1,))
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        agent.notice.arm()
        agent._check_notice()  # armed, no notice yet
        try:
            signal.raise_signal(signal.SIGUSR1)
        except Exception:  # as TorchElastic's log tailer does while it stops workers
            pass
        with pytest.raises(preempt.Preempted) as err:
            agent._check_notice()
        assert err.value.signum == signal.SIGUSR1 and err.value.sigval == signal.SIGTERM
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_master_host_waits_for_every_node_alive_at_the_notice_to_journal_its_preemption():
    """Alive at the notice, not now: a node's beats stop with its workers, and a node still persisting
    for longer than the freshness window must not be requeued (and killed) under it."""
    notice = 1000.0
    nodes = [
        {"node_id": "a", "state": "alive", "last_heartbeat": notice + 0.5},
        {"node_id": "b", "state": "alive", "last_heartbeat": notice - 1.0},  # silent since: persisting
        {"node_id": "gone", "state": "alive", "last_heartbeat": notice - 60.0},  # silent long before
    ]
    answers = iter(
        [{"nodes": nodes, "incidents": [{"kind": "preempted", "node_id": "a"}]}] * 3
        + [{"nodes": nodes, "incidents": [{"kind": "preempted", "node_id": n} for n in ("a", "b")]}]
    )
    assert preempt.wait_for_peers(lambda: next(answers), notice, timeout_s=30)
    assert next(answers, None) is None, "it waited for b, silent since the notice"
    lonely = {"nodes": nodes[1:2], "incidents": []}
    assert not preempt.wait_for_peers(lambda: lonely, notice, timeout_s=0.3), "bounded: gives up and says so"
