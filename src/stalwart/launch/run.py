"""`stalwart run`: torchrun's command line and rendezvous, with a stalwart agent and job master.

torchrun's own parser and `config_from_args` read the torchrun flags, so a torchrun command line
behaves the same here; our flags are added to the same parser. For single-host jobs a master is
started inside this process (loopback, a generated token), unless `--master` names one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed import run as torchrun
from torch.distributed.elastic import rendezvous
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from stalwart import _compat, runtime
from stalwart.chaos import faults
from stalwart.checkpoint.desk_host import Membership
from stalwart.health.precheck import PrecheckConfig
from stalwart.health.throttle import Throttle
from stalwart.launch import (
    autoscale,
    die_with_agent,
    eviction,
    nccl_env,
    park,
    preempt,
    share,
    slurm,
    stragglers,
    zygote,
)
from stalwart.launch.agent import NodeEvicted, NodeParked, StalwartAgent
from stalwart.launch.client import MasterClient, MasterError, write_address
from stalwart.launch.failure_save import FailureSave
from stalwart.launch.master import Master, load_or_create_token
from stalwart.launch.run_args import (
    EXIT_EVICTED,
    build_parser,
    hang_policy,
    master_store,
    rendezvous_defaults,
    replica_env,
    replica_sync,
    replicas,
)
from stalwart.launch.storage_watch import StorageWatch

if TYPE_CHECKING:
    from stalwart.checkpoint.keeper_process import KeeperProcess
    from stalwart.checkpoint.node_job import NodeJob

log = logging.getLogger("stalwart.run")
UNBOUNDED = 1 << 30  # local restart counter: the master's job-wide budget decides


def run(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    policy = hang_policy(args)
    notice = preempt.Preemption(preempt.parse_signals(args.preempt_signals))
    notice.shield()  # before the zygote and the keeper start
    token = args.job_token or os.environ.get(runtime.ENV_JOB_TOKEN)
    master: Master | None = None
    step = slurm.from_env(os.environ)
    if step is not None:  # inside `srun`: the allocation names the nodes and the master's host
        slurm.apply(args, parser, step, os.environ)
        master, token = _slurm_master(args, step, token)
    if args.master:
        if not token:
            raise ValueError("--master needs the job token: pass --job-token or set STALWART_JOB_TOKEN")
        master_store(args, MasterClient(args.master, token, retry_for_s=args.master_retry))
    share.validate(args)
    rendezvous_defaults(args)
    config, cmd, cmd_args = torchrun.config_from_args(args)
    trainer = zygote.runs_stalwart(list(cmd_args))  # its keeper will persist: it imports DCP at once
    warm = zygote.from_args(args, cmd, cmd_args)  # cmd_args already have the local-rank macro
    if warm is not None:
        cmd, cmd_args = warm.entrypoint(cmd_args)
        os.environ.update(warm.env())
    else:  # cold: the workers die with this agent even if it is SIGKILLed
        cmd, cmd_args = die_with_agent.entrypoint(cmd, list(cmd_args))
    run_dir = args.run_dir or Path("runs") / args.rdzv_id
    run_dir.mkdir(parents=True, exist_ok=True)
    node_id = args.node_id or f"{os.uname().nodename}-{os.getpid()}"
    # Worker logs must land in files for diagnosis; tee keeps them on the console as torchrun does.
    log_dir = args.log_dir or str(run_dir / "logs")
    logs_specs = DefaultLogsSpecs(
        log_dir=log_dir,
        redirects=Std.from_str(args.redirects),
        tee=Std.ALL if args.tee == "0" and args.redirects == "0" else Std.from_str(args.tee),
    )
    if args.chaos:
        faults.parse(args.chaos)  # a typo fails here, not in every worker
        os.environ[runtime.ENV_CHAOS] = args.chaos
    # Faults injected into the running job (`stalwart chaos`) arrive with the heartbeats and go to
    # this file, which workers re-read when it changes; "once" markers are per run directory, so
    # the same spec fires again in a later run.
    chaos_file = Path(os.environ.get(runtime.ENV_CHAOS_FILE) or run_dir / "chaos" / "injected").absolute()
    if runtime.ENV_CHAOS_FILE not in os.environ:
        chaos_file.unlink(missing_ok=True)  # the master delivers this job's injected faults again
    os.environ[runtime.ENV_CHAOS_FILE] = str(chaos_file)
    os.environ.setdefault(runtime.ENV_CHAOS_DIR, str((run_dir / "chaos" / "fired").absolute()))
    slow = faults.due("node")  # chaos slow:at=node: this whole node computes F× slower (a straggler)

    if args.master:
        address = args.master
    else:
        token = load_or_create_token(run_dir / "token", args.job_token)
        master = Master(
            run_dir / "journal.sqlite",
            token,
            job_id=args.rdzv_id,
            restart_budget=args.max_restarts,
            stragglers=stragglers.from_args(args),
            policy=eviction.from_args(args),
            autoscaler=autoscale.from_args(args),
        ).start()
        address = master.address
    os.environ.update({runtime.ENV_MASTER: address, runtime.ENV_JOB_ID: args.rdzv_id, runtime.ENV_NODE_ID: node_id})
    # A master of this node's own hears this node only: across nodes the checkpoint decider is then rank
    # 0's keeper's (checkpoint/desk_host.py), as under plain torchrun.
    shared = bool(args.master) or torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    os.environ[runtime.ENV_SHARED_MASTER] = "1" if shared else "0"
    os.environ[runtime.ENV_AGENT] = uuid.uuid4().hex  # this launch of the node's agent (its keeper says so)
    client = MasterClient(address, token, retry_for_s=args.master_retry)
    write_address(run_dir, address, args.rdzv_id, node_id)

    params = rendezvous.RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _compat.rendezvous_addr_and_port(params)
    _compat.rendezvous_poll(config.max_nodes)  # a restart's round: not a second late for the last node
    _compat.quick_agent_paths()  # nor ~0.2 s of stack inspection, nor 0.1 s waiting for the log tees
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = preempt.torch_signals(config.signals_to_handle, notice.signals)
    # A fresh worker store every round. torch shares the rendezvous TCP store with the workers
    # across rounds without a per-round prefix, so restarted workers read their predecessors' gloo
    # addresses and fail with "connectFullMesh ... Connection refused", burning a restart. The agent
    # of group rank 0 hosts each round's store itself (StalwartAgent._serve_worker_store).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if replicas(args) > 0:  # a third snapshot slot: copies that trail by two steps still meet the survivors'
        os.environ.setdefault(runtime.ENV_SNAPSHOT_SLOTS, "3")
    if sync := replica_sync(args):  # the workers' saves wait for copies (the keeper learns it from replica_env)
        os.environ[runtime.ENV_REPLICA_SYNC] = sync
    os.environ[runtime.ENV_EXIT_GRACE] = repr(args.exit_grace)  # a returned script's process ends within it
    nccl_env.apply_defaults(os.environ, args.nccl_env == "on")  # the user's own values win
    # The keeper's own environment carries the job token: peer replicas, and the master's lost nodes.
    keeper_env = {**replica_env(args, address, token), runtime.ENV_JOB_TOKEN: token}
    node_job, keeper = _start_keeper(args.rdzv_id, node_id, run_dir, keeper_env, eager=trainer)
    failure_save = FailureSave(node_job, Membership(address, token, node_id) if shared else None)
    storage_watch = StorageWatch(keeper.status_copy)

    def watch_keeper() -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Each monitor tick: a keeper that died is replaced, then its storage news is read."""
        if (replaced := keeper.ensure()) is not None:
            print(f"stalwart run: {replaced}", file=sys.stderr, flush=True)
        return storage_watch()

    slowed = slow is not None and slow.action == "delay"
    governed = share.throttle_factory(args, run_dir)  # --share-with: yield to a production job

    def new_agent() -> tuple[WorkerSpec, StalwartAgent]:
        """A fresh rendezvous handler and agent: the first, and one per return from parking."""
        spec = WorkerSpec(
            role=config.role,
            local_world_size=config.nproc_per_node,
            entrypoint=cmd,
            args=tuple(cmd_args),
            rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
            max_restarts=UNBOUNDED,
            monitor_interval=config.monitor_interval,
            master_addr=master_addr,
            master_port=master_port,
            local_addr=config.local_addr,
        )
        agent = StalwartAgent(
            spec,
            logs_specs,
            master=client,
            node_id=node_id,
            run_dir=run_dir,
            hang_policy=policy,
            start_method=config.start_method,
            window_s=args.straggler_window,
            on_failure=failure_save,
            chaos_file=chaos_file,
            precheck=PrecheckConfig() if args.precheck else None,
            throttle=governed or (partial(Throttle, factor=slow.node_factor) if slowed else None),
            join_info={"min_nodes": config.min_nodes, "max_nodes": config.max_nodes},
            zygote=warm,
            storage_watch=watch_keeper,
            exit_grace_s=args.exit_grace,
            local_restarts=args.max_restarts,
        )
        agent.notice = notice
        return spec, agent

    spec, agent = new_agent()
    exit_code, evicted, preempted = 0, None, None
    try:
        notice.arm()
        while True:
            try:
                result = agent.run()
                break
            except NodeParked as err:  # the autoscaler shrank the job: wait as a spare, out of the round
                agent.leave_rendezvous()
                print(f"stalwart run: node {node_id} parked as a spare: {err}", file=sys.stderr, flush=True)
                if not park.wait_unparked(client, node_id, spec.rdzv_handler):
                    result = None  # the job finished while this node was parked
                    break
                print(f"stalwart run: node {node_id} unparked: rejoining the job", file=sys.stderr, flush=True)
                spec, agent = new_agent()
        if (missed := notice.missed()) is not None:
            raise missed
        if result is None:  # TorchElastic's graceful exit: the job closed the rendezvous while we waited
            print(f"stalwart run: node {node_id} waited as a spare and the job finished without it", file=sys.stderr)
        elif result.is_failed():
            exit_code = 1
            first = min(result.failures.items(), default=None, key=lambda kv: kv[1].timestamp)
            what = f"rank {first[0]} exit code {first[1].exitcode}" if first else "a hang"
            print(f"stalwart run: job failed ({what}); journal: {run_dir / 'journal.sqlite'}", file=sys.stderr)
    except NodeEvicted as err:
        exit_code, evicted = EXIT_EVICTED, str(err)
        agent.leave_rendezvous()  # not shutdown(): that would close the rendezvous for every node
        print(
            f"stalwart run: node {node_id} left the job: {err}. The other nodes regroup without it (with a "
            f"waiting spare if there is one); journal: {run_dir / 'journal.sqlite'}",
            file=sys.stderr,
        )
    except RendezvousClosedError:
        print(f"stalwart run: node {node_id} waited for a place and the job finished without it", file=sys.stderr)
    except ChildFailedError:
        exit_code = 1
    except preempt.Preempted as err:  # TorchElastic stopped the workers: persist what they left in memory
        exit_code = preempt.EXIT_PREEMPTED
        preempted = preempt.persist_on_preempt(err, failure_save, time.time())
        preempt.journal(client, node_id, preempted)
        print(f"stalwart run: node {node_id} preempted ({preempted['signal']}): {preempted['save']}", file=sys.stderr)
    finally:
        notice.disarm()
        if evicted is None:
            spec.rdzv_handler.shutdown()
        if warm is not None:
            warm.stop(wait=preempted is None)
        if preempted is None:
            keeper.stop()  # after the workers: it saves on failure for those that did not finish
        else:  # the step is committed: let it tidy up while this agent exits (a moment to hear what it kept)
            keeper.stop(wait_s=2.0)
        if (kept := keeper.kept()) is not None:
            print(f"stalwart run: {kept}", file=sys.stderr)
        agent.journal.worker_reports(storage_watch()[0])  # what the keeper's final pass reported
        summary = {
            **_summary(client, node_id, exit_code, agent),
            "evicted": evicted,
            "prechecks": agent.prechecks,
            "storage": storage_watch.status,
        }
        if isinstance(agent.throttle, share.ShareGovernor):
            summary["share"] = agent.throttle.summary()
        if preempted is not None:
            # Every node's word before the requeue: Slurm kills what is left of the step KillWait
            # seconds after it, and the master's node must not take the others' journal with it.
            if master is not None and not preempt.wait_for_peers(master.state.status, preempted["received"]):
                print("stalwart run: a node's preemption may be missing from the journal", file=sys.stderr)
            if args.requeue_on_preempt and (step is None or step.hosts_master):
                preempted["requeue"] = preempt.requeue(os.environ)
            summary["preempted"] = {**preempted, "exit": time.time()}
        if args.summary_json:
            args.summary_json.write_text(json.dumps(summary, indent=1))
        if master is not None:
            master.stop()
    return exit_code  # `stalwart run` ends the process without interpreter finalization (commands/run.py)


def _slurm_master(
    args: argparse.Namespace, step: slurm.SlurmStep, token: str | None
) -> tuple[Master | None, str | None]:
    """Task 0 of a multi-task step starts the job master on the first host, serving the rendezvous
    store on the next port; the token is shared through the run directory (or $STALWART_JOB_TOKEN)."""
    if not args.master or args.master != slurm.master_address(step, os.environ):
        return None, token  # a single task, or the user named a master
    token_file = (args.run_dir or Path("runs") / args.rdzv_id) / "token"
    if not step.hosts_master:
        return None, token or slurm.wait_for_token(token_file)
    token = load_or_create_token(token_file, token)
    port = int(args.master.rsplit(":", 1)[1])
    master = Master(
        token_file.parent / "journal.sqlite",
        token,
        host=step.first_host,
        port=port,
        job_id=args.rdzv_id,
        restart_budget=args.max_restarts,
        stragglers=stragglers.from_args(args),
        rdzv_port=port + 1,
        policy=eviction.from_args(args),
        autoscaler=autoscale.from_args(args),
    ).start()
    return master, token


def _start_keeper(
    job_id: str, node_id: str, run_dir: Path, env: dict[str, str], eager: bool
) -> tuple[NodeJob, KeeperProcess]:
    """The node's keeper for the job's shared-memory directory (flash checkpoints, see
    stalwart.checkpoint), started before the workers and stopped when this agent exits, as the zygote
    is. It learns storage and policy from the job.json the workers write, and idles without one (without
    torch, unless ``eager``: the trainer's job checkpoints, and its first persist should not wait for
    the keeper's imports)."""
    # Imported now, not at the first failure: DCP is ~660 modules, seconds on the restart's critical path.
    from stalwart.checkpoint.keeper_process import KeeperProcess
    from stalwart.checkpoint.node_job import NodeJob
    from stalwart.checkpoint.shm import default_shm_root
    from stalwart.checkpoint.shm_gc import collect

    if (stale := collect(default_shm_root())) is not None:  # ended jobs' snapshots: the expired go now
        print(f"stalwart run: {stale}", file=sys.stderr)
    job = NodeJob.of_agent(job_id, node_id)
    return job, KeeperProcess(job, run_dir.absolute() / "keeper.log", env=env, eager=eager).start()


def _summary(client: MasterClient, node_id: str, exit_code: int, agent: StalwartAgent) -> dict[str, Any]:
    incidents = [
        {
            "kind": i.kind,
            "class": i.cls,
            "ranks": i.ranks,
            "retry": i.retry,
            "fault": i.fault,
            "detected": i.detected,
            "first_step": i.details.get("first_step"),
            "exitcode": i.details.get("exitcode"),
            "last_step": i.last_step,
            "consequential": i.details.get("consequential", False),
        }
        for i in agent.incidents
    ]
    status: dict[str, Any] = {}
    try:
        status = client.call("GET", "/v1/status", retry_for_s=2)
        restarts = status["restarts_used"]
    except (OSError, MasterError):  # the master may be gone with its node (a preemption)
        restarts = None
    return {
        "node_id": node_id,
        "exit_code": exit_code,
        "incidents": incidents,
        "restarts_used": restarts,
        "stragglers": status.get("stragglers") if restarts is not None else None,
    }
