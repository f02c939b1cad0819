"""A child's life tied to its parent's: what keeps the zygote's workers and the agent's keeper from
outliving the agent (``stalwart run`` leaves no process behind, whatever way it ends), and a worker's
end: bounded, in the interpreter's order, without interpreter finalization (``exit_process``)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

from stalwart.runtime import progress
from stalwart.runtime.env import ENV_EXIT_GRACE, worker_env

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, sig: int = signal.SIGKILL, *, exit_if_gone: bool = True) -> bool:
    """Have the kernel send ``sig`` to this process when ``parent`` (more exactly: the parent's thread
    that forked it) exits. With ``exit_if_gone``, exits at once if the parent is already gone (it died
    before the call took effect); else the caller checks. False where prctl is unavailable (not
    Linux): the caller then relies on its own checks."""
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig) == 0
    except (OSError, AttributeError):
        armed = False
    if exit_if_gone and os.getppid() != parent:
        with contextlib.suppress(OSError):  # said: an exit 1 with an empty log had no name (CI, issue 28)
            os.write(2, f"stalwart: exiting: parent process {parent} is gone (now {os.getppid()})\n".encode())
        os._exit(1)
    return armed


def exit_process(code: int) -> NoReturn:
    """End the process as the interpreter's own exit does, in its order — threading's exit hooks (they
    stop ``ThreadPoolExecutor`` workers), then the join of every non-daemon thread, then atexit handlers,
    streams flushed — bounded by the worker's exit grace, and skip interpreter finalization, which a
    worker must not reach:

    - a process-group thread (gloo's ``runLoop``) may still be releasing a finished collective's
      tensors, which takes the GIL; during finalization CPython ends such a thread with
      ``pthread_exit``, and the unwind through torch's C++ aborts the process ("terminate called
      without an active exception", exit -6, after a clean last step: seen after ``all_gather_object``
      and after FSDP2's ``get_state_dict`` even with ``destroy_process_group``; pytorch/pytorch#190489);
    - a worker forked from the zygote would also finalize what the zygote imported.

    Joining without the exit hooks first never ends a script that left an executor (or a
    ``Checkpointer``) open: its idle worker threads wait for work forever (seen on an H100 with
    nanoGPT). A thread that never ends is named, with its stack, and the process ends with ``code``
    after the grace (``STALWART_EXIT_GRACE_S``): the script's work is done and must not be redone.
    """
    try:
        _ending(code)
        _shutdown_threads()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(code)


def watch_interpreter_exit() -> None:
    """Bound the interpreter's own exit too (a cold-started worker): threading runs this hook before
    it joins non-daemon threads. Registered once, by the first progress writer of the process, and
    registered last among threading's hooks known by then, so that it runs first (they run in reverse):
    ``concurrent.futures``' own hook joins executor threads without a bound."""
    global _watching_pid
    if _watching_pid == os.getpid():
        return
    _watching_pid = os.getpid()
    register = getattr(threading, "_register_atexit", None)  # CPython ≥ 3.9; private, hence the guard
    if register is not None:
        import concurrent.futures.thread  # noqa: F401 (registers its exit hook now, before ours)

        try:
            register(_ending)
        except RuntimeError:  # the interpreter is already shutting down
            pass


WATCHDOG_THREAD = "stalwart-exit-watchdog"  # the agent leaves it out when it names a stuck rank's threads
_watching_pid = 0  # the process that registered the hook: a forked child (a DataLoader worker) inherits it
_ended: int | None = None  # the exit code once the end has begun


def _ending(code: int | None = None) -> None:
    """The end begins (once): a returned script marks its progress record (the agent then does not take
    the rank for hung) and a watchdog ends the process after the grace. ``code`` None: the interpreter's
    own exit, where the code is 1 after an uncaught exception and 0 otherwise (a ``sys.exit(n)``
    cannot be seen from here: a worker ended by the watchdog after one exits 0)."""
    global _ended
    if _ended is not None:
        return
    if code is None:
        if os.getpid() != _watching_pid:  # the hook, inherited by a forked child: not this worker's end
            return
        code = 1 if getattr(sys, "last_value", None) is not None else 0
    _ended = code
    if code == 0:
        progress.returned()
    grace = worker_env().exit_grace_s
    try:
        threading.Thread(target=_watchdog, args=(code, grace), name=WATCHDOG_THREAD, daemon=True).start()
    except RuntimeError:  # no new threads at this point of the interpreter's shutdown: the agent still ends it
        pass


def _watchdog(code: int, grace_s: float) -> None:
    time.sleep(grace_s)
    me = threading.current_thread()
    frames = sys._current_frames()
    stuck = [t for t in threading.enumerate() if t is not me and not t.daemon and t is not threading.main_thread()]
    rank = os.environ.get("RANK", "0")
    names = ", ".join(repr(t.name) for t in stuck) or "its exit handlers (main thread)"
    lines = [
        f"stalwart: rank {rank}: the script ended (exit code {code}) {grace_s:g} s ago but its process did not: "
        f"still running: {names}. Ending it now with exit code {code}; the script's work is kept, nothing is "
        f"redone. Stop or join such threads before the script returns (or make them daemon threads); "
        f"{ENV_EXIT_GRACE}=SECONDS (stalwart run --exit-grace) allows longer ends.\n"
    ]
    for thread in [*stuck, threading.main_thread()]:
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is not None:
            lines.append(f"Thread {thread.name!r} (most recent call last):\n{''.join(traceback.format_stack(frame))}")
    try:
        os.write(2, "".join(lines).encode(errors="replace"))  # not sys.stderr: a stuck thread may hold its lock
    except OSError:
        pass
    os._exit(code)


def _shutdown_threads() -> None:
    """What the interpreter's exit does before atexit (``threading._shutdown``: exit hooks, then the join
    of non-daemon threads); where a Python lacks it, the join alone."""
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown) and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon and thread is not threading.main_thread():
            thread.join()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
