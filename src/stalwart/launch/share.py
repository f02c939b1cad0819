"""`stalwart run --share-with RUN_DIR`: an opportunistic job on the devices of a production job (AntMan's way).

The production job runs under its own `stalwart run` (its ``--run-dir`` is RUN_DIR) and knows nothing of
the guest. The guest's agent reads the production workers' progress records on this node (the same
64-byte records its own hang detector reads) and throttles its own workers with the SIGSTOP/SIGCONT duty
cycle of ``stalwart.health.throttle``: a feedback loop holds the production job's step time within
``(1 + bound)`` × its step time alone.

- **Probe**: the guest is held stopped for a window of production steps; their mean step time is the
  production job's own pace. Two probes open, then one recurs every ``probe_every`` windows, and the pace
  is the fastest of the last three: a change in its work is followed, and noise (its own first steps, a
  neighbour) errs on the production job's side.
- **Share**: the guest runs at duty cycle ``d`` (it may compute ``d`` of the time it wants) for a window;
  over the bound cuts ``d`` in proportion to the excess (at most by half; down to held), one within it
  adds ``step`` (up to free). So it settles just below the bound, as MuxFlow's and AntMan's controllers do.
- **Idle**: when the production job reports no step for ``idle_s`` (it ended, is restarting or saving)
  the guest runs free, and is held again for a probe once steps resume.

On a GPU, SIGSTOP stops the guest's kernel launches, not kernels already queued; ``--share-gpu-percent``
also caps the guest's SMs through CUDA MPS (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``; the MPS daemon must run).
Every window is written to ``RUN_DIR_OF_GUEST/share.jsonl`` and summed up in the run summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stalwart.health.throttle import Throttle
from stalwart.launch.client import ADDRESS_FILE
from stalwart.launch.progress import ProgressReader

log = logging.getLogger("stalwart.share")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--share-with",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run this job opportunistically beside the production job whose `stalwart run --run-dir` is RUN_DIR, "
        "on the same devices: its workers are stopped and continued so that the production job's step time "
        "stays within --share-bound of its step time alone (docs/sched.md, Sharing for real)",
    )
    group.add_argument(
        "--share-bound",
        type=float,
        default=0.1,
        help="with --share-with: the production job's allowed slowdown, 0.1 = 10%% (default 0.1)",
    )
    group.add_argument(
        "--share-gpu-percent",
        type=int,
        default=None,
        help="with --share-with on a GPU: also cap this job's share of SMs through CUDA MPS "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; needs the MPS daemon)",
    )


def validate(args: argparse.Namespace) -> None:
    """A typo fails before anything starts, naming what to change."""
    if args.share_with is None:
        return
    if not 0.0 < args.share_bound < 10.0:
        raise ValueError(f"--share-bound {args.share_bound} must be in (0, 10): the production job's allowed slowdown")
    if not args.share_with.is_dir():
        raise ValueError(
            f"--share-with {args.share_with} is not a directory: name the production job's `stalwart run --run-dir` "
            "(create it first to start this job before the production one; this one runs free until it trains)"
        )
    if args.share_gpu_percent is not None:
        if not 1 <= args.share_gpu_percent <= 100:
            raise ValueError(f"--share-gpu-percent {args.share_gpu_percent} must be in 1..100")
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.share_gpu_percent)  # inherited by the workers


@dataclass(frozen=True)
class Window:
    """One measurement: the production job's mean step time while the guest ran at ``duty``."""

    phase: str  # "probe" (guest held), "share" or "idle" (the production job made no step: guest free)
    duty: float
    start: float  # wall-clock times of the first and last production step measured
    end: float
    steps: int
    host_step_s: float
    host_alone_s: float | None = None  # the pace it was compared with (share windows)


class HostSteps:
    """The production job's progress on this node: the slowest local rank's step and its report time."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._reader: ProgressReader | None = None
        self._inodes: dict[int, int | None] = {}

    def _open(self) -> ProgressReader | None:
        if self._reader is None:
            try:
                node_id = json.loads((self.run_dir / ADDRESS_FILE).read_text())["node_id"]
            except (OSError, ValueError, KeyError):
                return None
            self._reader = ProgressReader(self.run_dir / "progress" / node_id)
        return self._reader

    def read(self) -> tuple[int, float] | None:
        """(step, time of its report) of the rank furthest behind; None while nothing trains."""
        reader = self._open()
        if reader is None:
            return None
        ranks = []
        for path in reader.directory.glob("rank*.progress"):
            try:
                rank, inode = int(path.name[4:].split(".")[0]), path.stat().st_ino
            except (OSError, ValueError):  # removed meanwhile (its agent restarts the workers), or not a record
                continue
            if self._inodes.get(rank) != inode:  # its agent restarted the workers: a new record
                reader.forget(rank)
                self._inodes[rank] = inode
            ranks.append(rank)
        records = [r for r in map(reader.read, sorted(ranks)) if r is not None]
        if not records or any(r.phase in ("done", "returned") or r.step < 0 for r in records):
            return None
        slowest = min(records, key=lambda r: r.step)
        return slowest.step, slowest.time

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


@dataclass(frozen=True)
class Tuning:
    """The governor's windows and steps (defaults for steps of 10 ms to seconds)."""

    window_steps: int = 8  # a window is at least this many production steps …
    window_s: float = 0.5  # … and this long: short steps' times are noisy
    idle_s: float = 3.0  # no production step this long (or 5 steps' time): the guest runs free
    probe_every: int = 6  # share windows between probes
    step: float = 0.1  # the duty cycle's additive increase
    poll_s: float = 0.02  # how often the production job's records are read


class ShareGovernor(Throttle):
    """The guest's throttle, driven by the production job's measured step time (see the module doc)."""

    def __init__(
        self, pids: Callable[[], list[int]], host: HostSteps, bound: float, log_path: Path, tuning: Tuning = Tuning()
    ) -> None:
        super().__init__(pids, math.inf)
        self.set_factor(1.0)  # free until the production job trains (``_govern`` decides before any worker runs)
        self.host, self.bound, self.log_path, self.tuning = host, bound, log_path, tuning
        self._alone: list[float] = []  # the production job's step time in the recent probes
        self.duty = 0.5
        self.baseline_s: float | None = None
        self.windows: list[Window] = []
        self._halt = threading.Event()
        self._governor = threading.Thread(target=self._govern, name="stalwart-share", daemon=True)

    def start(self) -> ShareGovernor:
        super().start()
        self._governor.start()
        return self

    def close(self) -> None:
        self._halt.set()
        self._governor.join(5)
        super().close()
        self.host.close()

    def summary(self) -> dict[str, Any]:
        """What the run summary says of the sharing: the production job's slowdown and the guest's duty."""
        shared = [w.host_step_s for w in self.windows if w.phase == "share"]
        alone = [w.host_step_s for w in self.windows if w.phase == "probe"]
        ratio = statistics.median(shared) / statistics.median(alone) if shared and alone else None
        return {
            "share_with": str(self.host.run_dir),
            "bound": self.bound,
            "windows": {p: sum(w.phase == p for w in self.windows) for p in ("probe", "share", "idle")},
            "host_step_s_alone": statistics.median(alone) if alone else None,
            "host_slowdown": ratio,
            "mean_duty": statistics.fmean(w.duty for w in self.windows if w.phase == "share") if shared else None,
        }

    # -- the loop ------------------------------------------------------------------------------------
    def _govern(self) -> None:
        try:
            self._control()
        except Exception:  # a bug here must not leave the guest held (its hang detector ignores held time)
            self.set_factor(1.0)
            log.exception("stalwart run --share-with: the governor stopped; this job now runs unthrottled")

    def _control(self) -> None:
        since_probe = 0
        if self.host.read() is None:  # no production job training (yet): the guest runs free meanwhile
            self._go_idle(None)
        while not self._halt.is_set():
            if len(self._alone) < 2 or since_probe >= self.tuning.probe_every:
                self.set_factor(math.inf)
                window = self._measure("probe", 0.0)
                if window is not None:
                    self._alone = [*self._alone[-2:], window.host_step_s]
                    self.baseline_s, since_probe = min(self._alone), 0
                continue
            since_probe += 1
            self.set_factor(1.0 / self.duty if self.duty > 0 else math.inf)
            window = self._measure("share", self.duty)
            if window is None:
                continue
            over = window.host_step_s / ((1.0 + self.bound) * self.baseline_s)
            if over > 1.0:  # cut in proportion (at most by half): a noisy window costs the guest little
                self.duty = self.duty * max(0.5, 1.0 / over) if self.duty > self.tuning.step / 4 else 0.0
            else:
                self.duty = min(1.0, self.duty + self.tuning.step)

    def _measure(self, phase: str, duty: float) -> Window | None:
        """The production job's mean step time over the next window (``window_steps`` and ``window_s``, for
        short steps: their times are noisy); None (the guest set free
        meanwhile) if it makes no step for ``idle_s``, or when the governor is closed."""
        first = self._next_step(None)  # the step under way when the duty changed is not measured
        if first is None:
            return None
        last = first
        while last[0] - first[0] < self.tuning.window_steps or last[1] - first[1] < self.tuning.window_s:
            now = self._next_step(last)
            if now is None:
                return None
            last = now
        steps = last[0] - first[0]
        window = Window(phase, duty, first[1], last[1], steps, (last[1] - first[1]) / steps, self.baseline_s)
        self._record(window)
        return window

    def _next_step(self, after: tuple[int, float] | None) -> tuple[int, float] | None:
        """The first production report newer than ``after`` (or than now); None after ``idle_s`` without."""
        start, since = self.host.read(), time.monotonic()
        while not self._halt.wait(self.tuning.poll_s):
            now = self.host.read()
            base = after or start
            if now is not None and (base is None or now[0] > base[0]):
                return now
            if time.monotonic() - since > max(self.tuning.idle_s, 5 * (self.baseline_s or 0.0)):
                self._go_idle(now or base)
                return None
        return None

    def _go_idle(self, last: tuple[int, float] | None) -> None:
        """Nothing to protect: the guest runs free until the production job steps again, then probes."""
        self.set_factor(1.0)
        t0 = time.time()
        while not self._halt.wait(self.tuning.poll_s * 5):
            now = self.host.read()
            if now is not None and (last is None or now[0] != last[0]):
                break
        self._record(Window("idle", 1.0, t0, time.time(), 0, math.nan))
        self.baseline_s, self._alone = None, []  # a new run (or phase) of the production job: probe afresh

    def _record(self, window: Window) -> None:
        self.windows.append(window)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(asdict(window)) + "\n")


def throttle_factory(args: argparse.Namespace, run_dir: Path) -> Callable[[Callable[[], list[int]]], Throttle] | None:
    """What the agent calls with its worker pids to get the guest's throttle; None without --share-with."""
    if args.share_with is None:
        return None
    log_path = run_dir / "share.jsonl"
    log_path.unlink(missing_ok=True)
    return lambda pids: ShareGovernor(pids, HostSteps(args.share_with), args.share_bound, log_path)
