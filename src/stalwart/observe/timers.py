"""Section timers for the training step: where a step's time goes, at ~1 µs per section, no host sync.

    timer = SectionTimer(device)
    timer.begin_step(step)          # optional: tags the step and anchors its spans
    with timer.section("forward"): ...
    with timer.section("comm_wait", compute=False): ...
    sections = timer.step_done()   # {"forward": 0.012, ..., "compute_s": ..., "wait_s": ...} or None

On the CPU, sections are timed with ``perf_counter_ns`` and ``step_done`` returns this step's times.
On CUDA, sections record events on the current stream and are resolved *late*: ``step_done`` returns
the times of the newest earlier step whose events the GPU has passed (``Event.query``, which never
waits) — normally the previous step — or None when none has finished yet; ``resolved()`` returns
every finished step, oldest first. Nothing here synchronises, so the host keeps queueing work ahead
of the GPU. After ``begin_step`` a result also carries ``step`` and ``spans``: ``[name, start_ms,
dur_ms]`` per section occurrence, from the step's first section (for the merged timeline).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from stalwart.observe.records import STAGE_FORWARD

# name, counts as compute (None: nested in another section, in ms and spans but in neither sum), start,
# end (ns on the CPU, events on CUDA)
Section = tuple[str, bool | None, Any, Any]


def summarize(totals: dict[str, float], wait: set[str], nested: set[str] | None = None) -> dict[str, float]:
    """Seconds per section plus ``compute_s`` (the step's own work) and ``wait_s`` (communication);
    ``nested`` sections lie inside another one and count in neither."""
    out = dict(totals)
    out["compute_s"] = sum(v for k, v in totals.items() if k not in wait and k not in (nested or ()))
    out["wait_s"] = sum(v for k, v in totals.items() if k in wait)
    return out


class SectionTimer:
    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._open: list[Section] = []  # this step's sections
        self._step: int | None = None  # set by begin_step
        self._pending: deque[tuple[int | None, list[Section]]] = deque()  # CUDA: finished, unresolved

    def begin_step(self, step: int) -> None:
        """The step the next sections belong to (a step abandoned before ``step_done`` is dropped)."""
        self._open.clear()
        self._step = step

    @contextlib.contextmanager
    def section(self, name: str, compute: bool = True) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._open.append((name, compute, start, end))
            return
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self._open.append((name, compute, t0, time.perf_counter_ns()))

    def mark(self) -> Any:
        """A time for ``nested`` (where a context manager does not fit: module hooks)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def nested(self, name: str, start: Any, end: Any) -> None:
        """Add a section timed with ``mark()`` that lies inside another section of this step."""
        self._open.append((name, None, start, end))

    def discard(self) -> None:
        """Forget the current step's sections (a step that was not applied belongs to no step)."""
        self._open.clear()

    def _resolve(self, step: int | None, sections: list[Section]) -> dict[str, Any]:
        totals: dict[str, float] = {}
        wait: set[str] = set()
        nested: set[str] = set()
        spans: list[list[Any]] = []
        first = sections[0][2] if sections else None
        for name, compute, start, end in sections:
            if self.cuda:
                begin_ms, dur_ms = first.elapsed_time(start), start.elapsed_time(end)
            else:
                begin_ms, dur_ms = (start - first) / 1e6, (end - start) / 1e6
            totals[name] = totals.get(name, 0.0) + dur_ms / 1e3
            spans.append([name, round(begin_ms, 3), round(dur_ms, 3)])
            if compute is None:
                nested.add(name)
            elif not compute:
                wait.add(name)
        out: dict[str, Any] = summarize(totals, wait, nested)
        if step is not None:
            out["step"], out["spans"] = step, spans
        return out

    def resolved(self) -> list[dict[str, Any]]:
        """End of a step: the results of every step now resolved, oldest first (CPU: this one)."""
        sections, self._open = self._open, []
        step, self._step = self._step, None
        if not self.cuda:
            return [self._resolve(step, sections)]
        if sections:
            self._pending.append((step, sections))
        out = []
        while self._pending and self._pending[0][1][-1][3].query():
            out.append(self._resolve(*self._pending.popleft()))
        return out

    def step_done(self) -> dict[str, Any] | None:
        """End of a step. CPU: its seconds per section plus ``compute_s`` and ``wait_s``. CUDA: those of
        the newest earlier step the GPU has finished, or None (never waits)."""
        done = self.resolved()
        return done[-1] if done else None


class StageForwards:
    """Times each pipeline stage's forward of each micro-batch (``STAGE_FORWARD``, nested in the step's
    "pipeline" section) through module hooks, so the model stays plain; the merged timeline draws the
    activation send → receive arrows from them. ``flush(n)`` after the schedule's step keeps the last
    ``n`` forwards per stage — micro-batches 0..n-1, which every schedule runs in order — and drops the
    shape-inference forward that a new schedule runs first."""

    def __init__(self, timer: SectionTimer, modules: list[torch.nn.Module], stage_ids: list[int]) -> None:
        self.timer = timer
        self.done: dict[str, list[tuple[Any, Any]]] = {}
        for module, stage in zip(modules, stage_ids):
            name, starts = STAGE_FORWARD.format(stage), []
            module.register_forward_pre_hook(lambda _m, _a, starts=starts: starts.append(timer.mark()))
            module.register_forward_hook(lambda _m, _a, _o, name=name, starts=starts: self._end(name, starts.pop()))

    def _end(self, name: str, start: Any) -> None:
        self.done.setdefault(name, []).append((start, self.timer.mark()))

    def flush(self, n_microbatches: int) -> None:
        for name, spans in self.done.items():
            for start, end in spans[-n_microbatches:]:
                self.timer.nested(name, start, end)
        self.done.clear()
