"""``stalwart.timer("name")``: a user's own section in the per-rank step records.

The trainer registers its section timer here (``set_section_timer``); a user's section then lands in
the same step record as the trainer's own (data, forward, ...), timed the same way (``perf_counter_ns``
on the CPU, CUDA events resolved a step late on a GPU) with no host sync. Without a registered timer
(a script not run by ``stalwart train``) the context manager does nothing. Stdlib only: this is part
of ``import stalwart``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_timer: Any = None  # stalwart.observe.timers.SectionTimer, or anything with .section(name, compute)


def set_section_timer(timer: Any) -> None:
    """Route ``stalwart.timer`` sections to ``timer`` (None: back to doing nothing)."""
    global _timer
    _timer = timer


@contextlib.contextmanager
def timer(name: str, compute: bool = True) -> Iterator[None]:
    """Time a section of the current step under ``name`` (``compute=False``: it waits on others, e.g.
    a collective). Sections of the same name within a step add up."""
    if not name or not isinstance(name, str):
        raise ValueError(f"stalwart.timer needs a non-empty section name, got {name!r}")
    active = _timer
    if active is None:
        yield
        return
    with active.section(name, compute):
        yield
