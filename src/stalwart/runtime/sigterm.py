"""A worker's SIGTERM in two steps: first what must not be cut half-way, bounded; then the end that
SIGTERM's default gives (killed by SIGTERM: the agent and TorchElastic read the same exit as before).

What must not be cut is a memory snapshot under way: the agent SIGTERMs every surviving worker when one
rank fails, and a survivor whose copy of step S is cut holds only S - 1, so the job restores S - 1 and
redoes a step although every other rank holds S (across nodes nothing else waits for that copy: the
chaos kill of tests waits for its own node's ranks only). Finishing it costs the stop the rest of one
copy, bounded by ``FINISH_BOUND_S`` (under the agent's 5 s between SIGTERM and SIGKILL).

Python runs signal handlers on the main thread only, between bytecodes. A main thread blocked in C (a
CUDA sync behind a collective that will never end, a gloo wait) would hold the SIGTERM back until the
agent's SIGKILL, seconds later than today. So the signal wakes a thread of ours through
``signal.set_wakeup_fd``, and that thread finishes and ends the process. The main thread's handler
only waits, bounded, swallowing what other handlers raise meanwhile (torch's SIGCHLD handler raises when
DataLoader workers die of the same SIGTERM; a second SIGTERM re-enters it), so the script never runs on
after the SIGTERM; it acts itself only where somebody took the wakeup fd since.
Installed only over SIGTERM's default and an unused wakeup fd (a script's own handler, an asyncio loop's
fd stay theirs); a forked child (a DataLoader worker) gets the default back, so its SIGTERM never reaches
the parent's thread through the inherited fd.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import NoReturn

FINISH_BOUND_S = 3.0  # all finishers together; the agent SIGKILLs 5 s after its SIGTERM (torch 2.11: 30 s)
THREAD = "stalwart-sigterm"

_finishers: dict[int, Callable[[float], object]] = {}
_lock = threading.Lock()  # held by the one path that ends the process
_installed_pid = 0
_next_id = 0
_forks_watched = False
_pipe: list[int] = []  # (read end, write end); the write end is what signal.set_wakeup_fd was given


def finish_before_sigterm(finish: Callable[[float], object]) -> Callable[[], None]:
    """Have ``finish(timeout_s)`` run when SIGTERM comes, before the process dies of it (all finishers
    within ``FINISH_BOUND_S``). Returns the call that removes it. Where the handler cannot be installed
    (not the main thread, a handler or wakeup fd already set, not a POSIX system), SIGTERM keeps its
    present meaning and ``finish`` never runs."""
    global _next_id
    _install()
    _next_id += 1
    key = _next_id
    _finishers[key] = finish

    def forget() -> None:
        _finishers.pop(key, None)
        if not _finishers:
            _uninstall()

    return forget


def installed() -> bool:
    """Whether this process's SIGTERM runs the finishers (tests, and the console's word on a stop)."""
    return _installed_pid == os.getpid()


def _install() -> None:
    global _installed_pid, _forks_watched
    if installed() or threading.current_thread() is not threading.main_thread() or os.name != "posix":
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    read_fd, write_fd = os.pipe()  # both close-on-exec: a spawned program inherits neither
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_fd)
        os.close(write_fd)
        return
    if previous != -1:  # somebody's (an event loop's): theirs stays, and so does SIGTERM's default
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    signal.signal(signal.SIGTERM, _on_signal)
    threading.Thread(target=_watch, args=(read_fd,), name=THREAD, daemon=True).start()
    _installed_pid, _pipe[:] = os.getpid(), [read_fd, write_fd]
    if not _forks_watched:
        os.register_at_fork(after_in_child=_forget_in_child)
        _forks_watched = True


def _uninstall() -> None:
    """The last finisher gone (a ``Checkpointer`` closed): SIGTERM's default and the wakeup fd back, the
    thread ended (its pipe closed), where this is the main thread; elsewhere all stays (harmless: with
    nothing to finish SIGTERM ends the process as its default does)."""
    global _installed_pid
    if not installed() or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_signal:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _, write_fd = _pipe
    current = signal.set_wakeup_fd(-1)
    if current != write_fd:  # somebody set theirs since: it stays
        signal.set_wakeup_fd(current)
    os.close(write_fd)  # the thread reads the end of its pipe and returns
    _installed_pid, _pipe[:] = 0, []


def _forget_in_child() -> None:
    """A forked child has no watcher thread, and its SIGTERM byte would land in the parent's pipe; its
    copies of the pipe's ends would keep the parent's thread from seeing the end of its pipe."""
    if _installed_pid != 0 and os.getpid() != _installed_pid:
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in _pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        _pipe.clear()
        _finishers.clear()


def _on_signal(signum: int, frame: object) -> None:
    """The main thread's handler. Our thread, woken through the wakeup fd, finishes and ends the process;
    this one waits for that (it acts itself only where somebody took the wakeup fd since), then ends the
    process if nothing else did. Left behind by a framework that wrapped it and put it back after the last
    finisher was gone (Lightning restores the handlers it found at fit's start): SIGTERM's default, at once."""
    if not installed():
        _die_of_sigterm()
    current = signal.set_wakeup_fd(-1)
    ours = bool(_pipe) and current == _pipe[1]
    signal.set_wakeup_fd(current, warn_on_full_buffer=not ours)
    # Our thread stands down where the fd is no longer ours, or where a framework's handler wrapped ours
    # (it calls this one): then the finishers run here.
    if not ours or signal.getsignal(signal.SIGTERM) is not _on_signal:
        _terminate()
    deadline = time.monotonic() + FINISH_BOUND_S + 1.0
    while time.monotonic() < deadline:
        with contextlib.suppress(BaseException):  # what another handler raises here must not run the script on
            time.sleep(0.05)
    _die_of_sigterm()


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:  # uninstalled: the write end closed
            os.close(read_fd)
            return
        # A handler the script set since ours keeps its say: it runs on the main thread, not here.
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _on_signal:
            _terminate()


def _terminate() -> None:
    """Run the finishers within the bound, then die of SIGTERM. Whoever comes second returns (the
    backstop timer ends the process whatever a finisher does)."""
    if not _lock.acquire(blocking=False):
        return
    backstop = threading.Timer(FINISH_BOUND_S + 0.5, _die_of_sigterm)  # a finisher that overstays its timeout
    backstop.daemon = True
    backstop.start()
    deadline = time.monotonic() + FINISH_BOUND_S
    for finish in list(_finishers.values()):
        while True:  # on the main thread another handler may raise inside a finisher: it is resumed
            try:
                finish(max(0.0, deadline - time.monotonic()))
                break
            except BaseException as err:  # the end must come whatever a finisher did
                if time.monotonic() >= deadline:
                    with contextlib.suppress(OSError):
                        os.write(2, f"stalwart: SIGTERM: finishing failed ({err!r}); ending now\n".encode())
                    break
                time.sleep(0.01)
    _die_of_sigterm()


def _die_of_sigterm() -> NoReturn:
    """SIGTERM's default disposition back, then the signal itself: the process ends killed by SIGTERM.
    libc's ``signal`` resets it on any thread, without running Python's pending handlers first."""
    try:
        libc_signal = ctypes.CDLL(None, use_errno=True).signal
        libc_signal.restype, libc_signal.argtypes = ctypes.c_void_p, (ctypes.c_int, ctypes.c_void_p)
        libc_signal(signal.SIGTERM, None)  # SIG_DFL is 0
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # delivered at once where unblocked; never reached in practice
    finally:
        with contextlib.suppress(BaseException):
            os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)
