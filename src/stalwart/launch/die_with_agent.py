"""The worker entrypoint under a cold start (``--warm-start off``): ties the worker's life to the agent's,
then execs the worker command in place (same pid, so signals and stack dumps reach the worker itself).

TorchElastic starts workers in their own sessions, so when the agent is SIGKILLed nothing stops them;
PR_SET_PDEATHSIG (kept across exec) has the kernel SIGKILL the worker when the agent's thread that
started it exits — TorchElastic starts workers from the agent's main thread. Warm-started workers die
with the zygote instead (see ``stalwart.launch.zygote``).

Kept free of stalwart and torch imports on purpose: it runs with ``-S`` (no site-packages).
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def entrypoint(cmd: str, cmd_args: list[str]) -> tuple[str, list[str]]:
    """What the agent gives TorchElastic instead of ``cmd cmd_args``."""
    return sys.executable, ["-S", os.path.abspath(__file__), str(os.getpid()), cmd, *cmd_args]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: TorchElastic's own shutdown still stops the workers when the agent exits normally
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
