"""NCCL and ProcessGroupNCCL settings that ``stalwart run`` gives its workers (docs/techniques.md,
"NCCL settings for long runs").

Each value is a default only: a variable already in the agent's environment (the user's, a cluster
module's) is left as it is, and ``--nccl-env off`` sets none. Workers inherit the agent's environment,
so setting them before the first worker starts covers cold and zygote-forked workers alike. They are
read only by NCCL and by torch's NCCL process group: gloo (CPU) jobs are unaffected.
"""

from __future__ import annotations

import argparse
from collections.abc import MutableMapping

# name → (value, why). The reasons are repeated, with sources, in docs/techniques.md.
NCCL_DEFAULTS: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "3",
        "a failed or timed-out collective ends the process (without ncclCommAbort, which can itself hang "
        "on a broken fabric), so the agent sees a dead rank and restarts instead of waiting on a hang",
    ),
    "TORCH_FR_BUFFER_SIZE": (
        "2000",
        "Flight Recorder keeps the last 2000 collectives per rank: what `stalwart`'s hang diagnosis reads",
    ),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", "a watchdog timeout writes the Flight Recorder buffer before the process ends"),
    "TORCH_NCCL_ENABLE_MONITORING": (
        "1",
        "a watchdog stuck inside a CUDA/NCCL call is itself detected and the process ended",
    ),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": ("600", "the monitor's bound on a stuck watchdog"),
    "NCCL_IB_TIMEOUT": (
        "22",
        "InfiniBand transport timeout 4.096 µs × 2^22 ≈ 17 s per retry (NCCL's default 20 ≈ 4 s): a link "
        "flap of a few seconds is ridden out instead of tearing down the connection and the job",
    ),
    "NCCL_IB_RETRY_CNT": ("7", "IB retries before an error (7 is the field's maximum), read with NCCL_IB_TIMEOUT"),
}


# A user's setting under torch's older name wins too (torch reads both; the old one warns as deprecated).
ALIASES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING",
}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--nccl-env",
        choices=("on", "off"),
        default="on",
        help="give the workers stalwart's NCCL defaults (async error handling, Flight Recorder dump on timeout, "
        "IB timeout and retries; docs/techniques.md); a variable already set in the environment always wins "
        "(default on)",
    )


def apply_defaults(environ: MutableMapping[str, str], enabled: bool = True) -> dict[str, str]:
    """Set each default that ``environ`` does not already hold; return what was set."""
    if not enabled:
        return {}
    added = {
        name: value
        for name, (value, _) in NCCL_DEFAULTS.items()
        if name not in environ and ALIASES.get(name, "") not in environ
    }
    environ.update(added)
    return added
