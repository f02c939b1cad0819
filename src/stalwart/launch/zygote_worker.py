"""The worker side of a warm start: what the zygote's forked child does to become ``python ARGV``.

The child takes the client's stdio fds, cwd and environment, forgets the worker contract the zygote
read (``runtime.reset``), dies with the zygote, and runs the script or module with ``runpy`` as the
interpreter would (exit codes, tracebacks without this module's frames, atexit, non-daemon threads).
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import sys
import traceback
from typing import Any

from stalwart import runtime


def parse_python_args(argv: list[str]) -> tuple[bool, str | None, str | None, list[str]]:
    """(unbuffered, module, script, rest) of ``python ARGV``; ValueError for what a fork cannot mimic."""
    unbuffered = False
    for i, arg in enumerate(argv):
        if arg == "-u":
            unbuffered = True
        elif arg == "-m" and i + 1 < len(argv):
            return unbuffered, argv[i + 1], None, argv[i + 2 :]
        elif arg.startswith("-"):
            raise ValueError(f"interpreter flag {arg!r}")
        else:
            return unbuffered, None, arg, argv[i + 1 :]
    raise ValueError("no script or module")


def _rebind_stdio(unbuffered: bool) -> None:
    def stream(fd: int) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "wb", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            binary, encoding="utf-8", errors="backslashreplace", line_buffering=not unbuffered, write_through=unbuffered
        )

    sys.stdout = sys.__stdout__ = stream(1)
    sys.stderr = sys.__stderr__ = stream(2)


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def _print_exception(err: BaseException) -> None:
    """The traceback as ``python ARGV`` prints it: without the frames of this module and runpy."""
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb)


def _forget_zygote_contract() -> None:
    """The worker contract is read lazily, once per process (``stalwart.runtime``): a module the zygote
    preloaded may have read it with the zygote's environment, which the forked worker must not see
    (``reset`` also drops the progress writer made from it)."""
    runtime.reset()


def become_worker(request: dict[str, Any], fds: list[int], zygote_pid: int) -> None:
    """Runs in the forked child: turn into ``python ARGV`` with the client's stdio; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        runtime.die_with_parent(zygote_pid)  # elsewhere the zygote's own cleanup kills its workers
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip(request["fds"], fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _forget_zygote_contract()
        unbuffered, module, script, rest = parse_python_args(request["argv"])
        _rebind_stdio(unbuffered)
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        try:
            if module is not None:
                sys.argv = ["-m", *rest]
                sys.path[0] = os.getcwd()
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [script, *rest]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as err:
            code = _exit_code(err)
        except KeyboardInterrupt as err:
            _print_exception(err)
            code = 128 + signal.SIGINT
        except BaseException as err:  # what Python's main does with an uncaught exception
            _print_exception(err)
            code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        runtime.exit_process(code)  # threads joined, atexit run, streams flushed; no finalization
