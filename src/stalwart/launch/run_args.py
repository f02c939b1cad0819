"""`stalwart run`'s command line: torchrun's parser with stalwart's flags added, and the defaults
torchrun derives from it (a local rendezvous for one node, the master-served store for c10d)."""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

from torch.distributed import run as torchrun

from stalwart import runtime
from stalwart.launch import autoscale, eviction, nccl_env, preempt, share, stragglers, zygote
from stalwart.launch.client import MasterClient
from stalwart.launch.hang import HangPolicy
from stalwart.launch.store import client_rdzv_conf

EXIT_EVICTED = 3  # this node left the job (evicted, or its precheck failed); the job goes on without it


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = torchrun.get_args_parser()
    parser.prog = "stalwart run"
    parser.description = (
        "Run a training script like torchrun, and keep it training through failures: heartbeats to a "
        "job master, hang detection with stack dumps, log diagnosis (user errors fail fast), a "
        "job-wide restart budget and an incident journal. All torchrun flags work as in torchrun; "
        "--max-restarts is the budget for the whole job, not per node (and each node's own while the "
        "master cannot be reached)."
    )
    g = parser.add_argument_group("stalwart")
    g.add_argument(
        "--master", default=None, help="job master URL (http://HOST:PORT) for multi-node jobs; default: start one here"
    )
    g.add_argument(
        "--job-token",
        default=os.environ.get(runtime.ENV_JOB_TOKEN),
        help="job token for the master (default $STALWART_JOB_TOKEN, else generated into RUN_DIR/token)",
    )
    g.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where the journal, logs and progress records go (default runs/RDZV_ID)",
    )
    g.add_argument("--node-id", default=None, help="this agent's name in the job (default HOST-PID)")
    g.add_argument(
        "--master-retry",
        type=_positive_seconds,
        default=30.0,
        help="seconds the agent keeps retrying an unreachable master (it may be restarting) before it "
        "goes on without it: restarts then come from this node's --max-restarts (default 30)",
    )
    g.add_argument(
        "--hang-timeout",
        default="auto",
        help="seconds without step progress before a rank is declared hung, or 'auto' = "
        "max(9 s, 2.7 × median step time), so a hang is reported within max(10 s, 3 × step "
        "time); first steps and checkpoint/eval phases get "
        "longer allowances (default auto)",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="allowance in seconds before the first steps report (default 120)",
    )
    g.add_argument(
        "--exit-grace",
        type=_positive_seconds,
        default=runtime.EXIT_GRACE_S,
        metavar="SECONDS",
        help="how long a worker whose script returned may take to end (threads it left running, exit "
        "handlers); then it names what still runs, with stacks, and ends with the script's exit code: "
        f"the job has finished, nothing is redone (default {runtime.EXIT_GRACE_S:g})",
    )
    g.add_argument(
        "--chaos",
        default=None,
        metavar="SPEC",
        help="fault injection for tests and demos, passed to workers as STALWART_CHAOS (e.g. kill:rank=1:step=7)",
    )
    g.add_argument(
        "--precheck",
        action="store_true",
        help="before the first start and every restart, burn in this node's devices (a seeded "
        "matmul per local worker, checked and timed); a node that fails, or that the "
        "master finds slow under --straggler-policy evict, leaves the job (exit code "
        f"{EXIT_EVICTED}) and the others go on without it, or with a waiting spare (default off)",
    )
    g.add_argument(
        "--straggler-window",
        type=float,
        default=5.0,
        help="seconds per window of compute times sent to the master (default 5)",
    )
    stragglers.add_arguments(g)
    eviction.add_arguments(g)
    autoscale.add_arguments(g)
    zygote.add_arguments(g)
    preempt.add_arguments(g)
    nccl_env.add_arguments(g)
    share.add_arguments(g)
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="K",
        help="copy each node's newest memory snapshot into the memory of K other nodes in the background, "
        "so a lost node's state is restored from a peer, not from storage (multi-node jobs; 0 = off; default 1)",
    )
    g.add_argument(
        "--replica-sync",
        action="store_true",
        help="a step's checkpoint call returns only once its snapshot is in the peers' memory (all ranks): a "
        "lost node then costs no completed step, at the price of the copy's time in every step (default: "
        "copies trail the training, and a node lost while its copy is on the way costs that step)",
    )
    g.add_argument(
        "--replica-overlap",
        action="store_true",
        help="like --replica-sync, but a step's copies overlap the next step: a checkpoint call waits for "
        "the previous step's copies, not its own, so it costs nothing while a copy takes less than a step, "
        "and a lost node costs at most the one step whose copy was on the way",
    )
    g.add_argument(
        "--replica-domain",
        default=os.environ.get(runtime.ENV_FAILURE_DOMAIN, ""),
        metavar="LABEL",
        help="this node's failure domain (e.g. its rack or switch): replicas go to other domains first "
        "(default $STALWART_FAILURE_DOMAIN)",
    )
    g.add_argument(
        "--replica-host",
        default=None,
        metavar="ADDR",
        help="address the keeper accepts peers' replicas on (default: --local-addr, else the address this "
        "node reaches the master from; loopback for a local master)",
    )
    g.add_argument(
        "--summary-json",
        type=Path,
        default=None,
        help="write the run's outcome (exit, incidents, restarts) here as JSON",
    )
    return parser


def hang_policy(args: argparse.Namespace) -> HangPolicy:
    if args.hang_timeout == "auto":
        return HangPolicy(startup_s=args.startup_timeout)
    try:
        timeout = float(args.hang_timeout)
    except ValueError:
        raise ValueError(f"--hang-timeout must be a number of seconds or 'auto', got {args.hang_timeout!r}") from None
    return HangPolicy(timeout_s=timeout, startup_s=args.startup_timeout)


def rendezvous_defaults(args: argparse.Namespace) -> None:
    """torchrun's own rule: --standalone, or a single node without an endpoint, gets a local c10d
    rendezvous on a free port with a fresh id."""
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    if args.standalone or (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and max_nodes == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        if args.standalone or args.rdzv_id == "none":
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def master_store(args: argparse.Namespace, client: MasterClient) -> None:
    """A c10d rendezvous without an endpoint uses the store the master serves (`stalwart master
    --rdzv-port`): no node hosts it, so losing any node leaves the rendezvous intact."""
    if args.rdzv_backend != "c10d" or args.rdzv_endpoint:
        return
    endpoint = client.status().get("rdzv_endpoint")
    if not endpoint:
        raise ValueError(
            "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT, or a master started with "
            "--rdzv-port to serve the rendezvous store"
        )
    args.rdzv_endpoint, args.rdzv_conf = endpoint, client_rdzv_conf(args.rdzv_conf)


def replica_host(args: argparse.Namespace, master_address: str) -> str:
    """Where this node's keeper listens for peers' replicas: loopback unless other hosts must reach it."""
    import socket
    from urllib.parse import urlsplit

    if args.replica_host:
        return str(args.replica_host)
    if getattr(args, "local_addr", None):
        return str(args.local_addr)
    host = urlsplit(master_address).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        target = socket.gethostbyname(host)
        if target.startswith("127."):  # the master's host name maps to loopback here (Debian: 127.0.1.1)
            target = "10.255.255.255"  # then the interface of the default route; no packet is sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def replicas(args: argparse.Namespace) -> int:
    """Peer copies per node snapshot: none for a job that can never span nodes."""
    if args.replicas < 0:
        raise ValueError(f"--replicas must be 0 (off) or a number of peer copies, got {args.replicas}")
    return args.replicas if torchrun.parse_min_max_nnodes(args.nnodes)[1] > 1 else 0


def replica_sync(args: argparse.Namespace) -> str:
    """How steps wait for their peer copies: ``"1"`` each for its own (``--replica-sync``), ``"overlap"``
    each for the previous step's (``--replica-overlap``), ``""`` not at all (also in a job that makes
    no copies)."""
    if args.replica_sync and args.replica_overlap:
        raise ValueError("--replica-sync and --replica-overlap are two ways to wait for copies: give one")
    flag, mode = ("--replica-overlap", runtime.REPLICA_OVERLAP) if args.replica_overlap else ("--replica-sync", "1")
    if (args.replica_sync or args.replica_overlap) and args.replicas == 0:
        raise ValueError(f"{flag} waits for the peer copies that --replicas 0 turns off; give --replicas ≥ 1")
    return mode if (args.replica_sync or args.replica_overlap) and replicas(args) > 0 else ""


def replica_env(args: argparse.Namespace, master_address: str, token: str) -> dict[str, str]:
    """The keeper's replica settings (the token stays out of the workers' environment)."""
    return {
        runtime.ENV_REPLICAS: str(replicas(args)),
        runtime.ENV_REPLICA_SYNC: replica_sync(args),
        runtime.ENV_REPLICA_HOST: replica_host(args, master_address),
        runtime.ENV_REPLICA_DOMAIN: args.replica_domain or "",
        runtime.ENV_REPLICA_KEY: token,
    }
