"""A child's life tied to its parent's: what keeps the zygote's workers and the agent's keeper from
outliving the agent (``stalwart run`` leaves no process behind, whatever way it ends), and a worker's
end without interpreter finalization (``exit_process``)."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

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
        os._exit(1)
    return armed


def exit_process(code: int) -> NoReturn:
    """End the process as the interpreter's own exit does (non-daemon threads joined, atexit handlers
    run, stdout/stderr flushed) but skip interpreter finalization, which a worker must not reach:

    - a process-group thread (gloo's ``runLoop``) may still be releasing a finished collective's
      tensors, which takes the GIL; during finalization CPython ends such a thread with
      ``pthread_exit``, and the unwind through torch's C++ aborts the process ("terminate called
      without an active exception", exit -6, after a clean last step: seen after ``all_gather_object``
      and after FSDP2's ``get_state_dict`` even with ``destroy_process_group``; pytorch/pytorch#190489);
    - a worker forked from the zygote would also finalize what the zygote imported.
    """
    try:
        me = threading.current_thread()
        for thread in threading.enumerate():  # as the interpreter's exit does, with public API
            if thread is not me and not thread.daemon and thread is not threading.main_thread():
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)
