"""`stalwart chaos`: inject one fault into a running job (through its master), or print the spec.

The master journals the spec and hands it to every agent with its next heartbeat; agents append it
to the chaos file their workers re-read at each step, and the `rank`/`step` keys pick who fires and
when. Without a target the spec is printed, for `stalwart run --chaos` or `STALWART_CHAOS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stalwart.chaos import faults
from stalwart.runtime import ENV_CHAOS, ENV_JOB_TOKEN, worker_env


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos",
        help="inject a fault into a running job (kill, segv, exception, hang, slow, nan, ...)",
        description="Inject one fault into a running `stalwart run` job: the job's master journals it and "
        "the agents pass it to their workers within about a heartbeat (1 s). It fires once, on "
        "the given rank after the given step (omit either to mean any). Name the job by "
        "--run-dir (the master address and token the run wrote there) or by --master and "
        "--job-token. With --print, or no target, only print the spec for `stalwart run "
        f"--chaos SPEC` / {ENV_CHAOS}.",
        epilog="examples:  stalwart chaos kill --rank 1 --at-step 120 --run-dir runs/demo/job\n"
        "           stalwart chaos slow --rank 0 --seconds 0.5 --master http://127.0.0.1:29600\n"
        '           stalwart run --chaos "$(stalwart chaos hang --rank 1 --at-step 50 --print)" ...',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "action",
        choices=faults.ACTIONS,
        help="kill = SIGKILL, segv = SIGSEGV, exit = exit(--code), exception/raise = RuntimeError, "
        "hang = spin without reaching the next collective, stop = SIGSTOP, slow/delay = sleep "
        "--seconds (every step unless --at-step), nan/spike = multiply the loss by NaN/--factor",
    )
    p.add_argument("--rank", type=int, default=None, help="global rank that fires (default: every rank)")
    p.add_argument(
        "--at-step",
        type=int,
        default=None,
        help="fire after this optimizer step (default: the next step the rank reaches)",
    )
    p.add_argument("--seconds", type=float, default=None, help="sleep per step for slow/delay")
    p.add_argument("--factor", type=float, default=None, help="loss multiplier for spike (default 1000)")
    p.add_argument("--code", type=int, default=None, help="exit code for exit (default 1)")
    target = p.add_argument_group("target (a running job)")
    target.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the job's run directory (reads master.json and, for a single-host job, token)",
    )
    target.add_argument("--master", default=None, help="job master URL (http://HOST:PORT)")
    target.add_argument("--job-token", default=None, help=f"job token (default ${ENV_JOB_TOKEN}, else RUN_DIR/token)")
    p.add_argument("--print", action="store_true", dest="print_only", help="print the spec; inject nothing")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    p.set_defaults(handler=run)


def build_spec(
    action: str,
    rank: int | None = None,
    step: int | None = None,
    seconds: float | None = None,
    factor: float | None = None,
    code: int | None = None,
) -> str:
    """The STALWART_CHAOS spec for one fault, validated by the same parser the workers use."""
    kind = faults.ALIASES.get(action, action)
    if seconds is not None and kind != "delay":
        raise ValueError(f"--seconds applies to slow/delay, not {action}")
    if factor is not None and kind != "spike":
        raise ValueError(f"--factor applies to spike, not {action}")
    if code is not None and kind != "exit":
        raise ValueError(f"--code applies to exit, not {action}")
    if kind == "delay" and not (seconds and seconds > 0):
        raise ValueError(f"{action} needs --seconds > 0 (the sleep per step)")
    if (rank is not None and rank < 0) or (step is not None and step < 1):
        raise ValueError("--rank must be ≥ 0 and --at-step ≥ 1")
    parts = [action]
    for key, value in (("rank", rank), ("step", step), ("seconds", seconds), ("factor", factor), ("code", code)):
        if value is not None:
            parts.append(f"{key}={value}")
    spec = ":".join(parts)
    faults.parse(spec)
    return spec


def resolve_target(run_dir: Path | None, master: str | None, token: str | None) -> tuple[str, str]:
    """(address, token) of the job's master from --master/--job-token or what the run wrote."""
    from stalwart.launch.client import ADDRESS_FILE

    if run_dir is not None and master is None:
        address_file = run_dir / ADDRESS_FILE
        if not address_file.exists():
            raise ValueError(
                f"{address_file} does not exist: is a `stalwart run --run-dir {run_dir}` job running? "
                "Or name the master with --master URL --job-token TOKEN"
            )
        master = json.loads(address_file.read_text())["address"]
    token = token or worker_env().job_token
    if not token and run_dir is not None and (run_dir / "token").exists():
        token = (run_dir / "token").read_text().strip()
    if not token:
        raise ValueError(
            f"no job token: pass --job-token or set {ENV_JOB_TOKEN} (a job with a separate "
            "`stalwart master` keeps its token next to the master's --db)"
        )
    assert master is not None
    return master, token


def run(args: argparse.Namespace, *_: Any) -> int:
    spec = build_spec(args.action, args.rank, args.at_step, args.seconds, args.factor, args.code)
    if args.print_only or (args.run_dir is None and args.master is None):
        print(spec)
        return 0
    from stalwart.launch.client import MasterClient, MasterError

    address, token = resolve_target(args.run_dir, args.master, args.job_token)
    client = MasterClient(address, token, retry_for_s=5.0)
    try:
        status = client.status()
        chaos_id = client.chaos(spec)
    except MasterError as err:
        raise ValueError(f"the master at {address} refused: {err}") from None
    except OSError as err:
        print(f"stalwart chaos: master at {address} unreachable ({err}); is the job running?", file=sys.stderr)
        return 1
    steps = [r.get("step", -1) for n in status["nodes"] for r in (n.get("progress") or {}).get("ranks", [])]
    current = max(steps, default=-1)
    late = args.at_step is not None and args.at_step <= current
    if late:
        print(
            f"stalwart chaos: warning: the job is already at step {current}; a fault at step {args.at_step} "
            "fires only if the job gets back there (after a restore)",
            file=sys.stderr,
        )
    outcome = {"id": chaos_id, "spec": spec, "master": address, "job_id": status["job_id"], "job_step": current}
    if args.json:
        print(json.dumps(outcome))
    else:
        print(
            f"injected #{chaos_id} {spec!r} into job {status['job_id']} (now at step {current}); "
            "agents pass it on within a heartbeat"
        )
    return 0
