"""A child's life tied to its parent's: what keeps the zygote's workers and the agent's keeper from
outliving the agent (``stalwart run`` leaves no process behind, whatever way it ends)."""

from __future__ import annotations

import ctypes
import os
import signal

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
