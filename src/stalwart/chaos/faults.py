"""Parse ``STALWART_CHAOS`` and fire faults at named points, each at most once per marker directory.

Grammar: ``ACTION[:key=value]...`` and several faults joined by ``;``.

actions  ``kill`` (SIGKILL the calling process), ``segv`` (SIGSEGV), ``exit`` (``os._exit(code)``),
         ``raise``/``exception`` (``RuntimeError``), ``hang`` (spin forever, never reaching the next
         collective), ``stop`` (SIGSTOP: a frozen process), ``delay``/``slow`` (sleep ``seconds``;
         fires every time unless ``once=1``); ``nan`` and ``spike`` are *numeric* faults that the
         trainer applies itself at point ``loss``: it multiplies the step's loss by ``Fault.scale``
         (NaN, or ``factor``, default 1000) before backward, poisoning loss and gradients.
         Node faults, applied by the node agent (``stalwart run``): ``node-fail`` (default point
         ``precheck``: the node's burn-in raises, as a broken device would), ``nan:at=precheck`` (the
         burn-in computes a wrong result), ``slow:at=precheck:factor=F`` (the burn-in runs F× slower)
         and ``slow:at=node:factor=F`` (the agent duty-cycles its workers with SIGSTOP/SIGCONT so the
         whole node computes F× slower: a straggler); F defaults to 3 for these.
         ``slow:at=forward:factor=F`` makes every forward section of the matching steps F× as long
         (one rank's slow compute, the per-section straggler).
keys     ``at`` point name (default ``step``; ``loss`` for nan/spike; ``precheck`` for node-fail;
         ``forward``: inside the step's first forward section, e.g. a stall at an exact step;
         ``saved``: right after the step's checkpoint call, before its metrics record),
         ``rank`` and ``step`` (omitted = any), ``code`` exit code (default 1), ``seconds`` for delay,
         ``factor`` for spike and node slowness, ``once`` (default 1 except for delay)

Specs come from ``STALWART_CHAOS`` and, for faults injected into a running job (``stalwart chaos``),
from the file named by ``STALWART_CHAOS_FILE`` (one spec per line; re-read when it changes, so a
worker pays one ``stat`` per check).

"Once" must hold across process restarts — a restarted worker has the same environment and must not
die again at the same step — so a fault that fires first creates a marker file in
``STALWART_CHAOS_DIR`` (default: ``<tmp>/stalwart-chaos``); a fault whose marker exists never fires.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stalwart import runtime

# The contract's names (stalwart.runtime), under the names chaos callers and tests know them by.
ENV_SPEC = runtime.ENV_CHAOS
ENV_DIR = runtime.ENV_CHAOS_DIR
ENV_FILE = runtime.ENV_CHAOS_FILE
ACTIONS = ("kill", "segv", "exit", "raise", "exception", "hang", "stop", "delay", "slow", "nan", "spike", "node-fail")
ALIASES = {"exception": "raise", "slow": "delay"}
NUMERIC = ("nan", "spike")  # applied by the trainer to the loss, not by fire()
NODE = ("node-fail",)  # applied by the node check (stalwart.health.precheck), not by fire()
NODE_FACTOR = 3.0  # slowness of node faults (precheck, node) when the spec names no factor
KEYS = ("at", "rank", "step", "code", "seconds", "factor", "once")


@dataclass(frozen=True)
class Fault:
    action: str
    at: str = "step"
    rank: int | None = None
    step: int | None = None
    code: int = 1
    seconds: float = 0.0
    factor: float = 1000.0
    once: bool = True
    text: str = ""

    @property
    def node_factor(self) -> float:
        """How many times slower a node fault makes the node: ``factor`` if the spec names one, else 3
        (the 1000 default suits loss spikes, not slowness)."""
        return self.factor if ":factor=" in f":{self.text}" else NODE_FACTOR

    @property
    def scale(self) -> float:
        """What a numeric fault multiplies the loss by."""
        assert self.action in NUMERIC, self.action
        return math.nan if self.action == "nan" else self.factor

    def matches(self, point: str, step: int | None, rank: int | None) -> bool:
        return (
            self.at == point and (self.rank is None or self.rank == rank) and (self.step is None or self.step == step)
        )

    @property
    def marker(self) -> Path:
        root = Path(runtime.chaos_marker_dir() or Path(tempfile.gettempdir()) / "stalwart-chaos")
        return root / (hashlib.sha1(self.text.encode()).hexdigest()[:16] + ".fired")

    def claim(self) -> bool:
        """True if this fault may fire now; for once-faults, atomically records that it fired."""
        if not self.once:
            return True
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.text}\npid={os.getpid()} time={time.time():.3f}\n")
        return True

    @property
    def ends_process(self) -> bool:
        """The fault ends (or stops) the process: what it leaves behind is what a test examines."""
        return self.action in ("kill", "segv", "exit", "raise", "hang", "stop")

    @property
    def stretches(self) -> bool:
        """``delay``/``slow`` with a ``factor``: stretch the section it is in by that factor."""
        return self.action == "delay" and ":factor=" in f":{self.text}"

    def stretch(self, elapsed_s: float) -> None:
        """Make a section that took ``elapsed_s`` take ``factor`` × as long (host time)."""
        time.sleep(max(self.factor - 1.0, 0.0) * elapsed_s)

    def fire(self) -> None:
        assert self.action not in NUMERIC + NODE, "numeric and node faults are applied by the caller"
        print(f"stalwart chaos: firing {self.text!r} in pid {os.getpid()}", file=sys.stderr, flush=True)
        if self.action != "delay":  # the agent reads when the fault began (exact MTTR)
            runtime.fault_fired()
        if self.action in ("kill", "segv", "stop"):
            sig = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "stop": signal.SIGSTOP}[self.action]
            os.kill(os.getpid(), sig)
            time.sleep(60)  # the signal is delivered asynchronously; never return into user code
        elif self.action == "hang":
            while True:
                pass
        elif self.action == "exit":
            os._exit(self.code)
        elif self.action == "raise":
            raise RuntimeError(f"chaos fault {self.text!r}")
        elif self.action == "delay":
            time.sleep(self.seconds)


def parse(spec: str) -> list[Fault]:
    """``"kill:rank=1:step=7;delay:seconds=1:at=persist"`` → faults; ValueError names the bad part."""
    faults = []
    for text in (part.strip() for part in spec.split(";")):
        if not text:
            continue
        action, *pairs = text.split(":")
        if action not in ACTIONS:
            raise ValueError(f"{ENV_SPEC}: unknown action {action!r} in {text!r}; use one of {', '.join(ACTIONS)}")
        action = ALIASES.get(action, action)
        kw: dict[str, object] = {
            "once": action != "delay",
            "at": "loss" if action in NUMERIC else "precheck" if action in NODE else "step",
        }
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in KEYS:
                raise ValueError(
                    f"{ENV_SPEC}: bad item {pair!r} in {text!r}; expected key=value with key in {', '.join(KEYS)}"
                )
            try:
                kw[key] = (
                    value
                    if key == "at"
                    else float(value)
                    if key in ("seconds", "factor")
                    else value.lower() in ("1", "true", "yes")
                    if key == "once"
                    else int(value)
                )
            except ValueError:
                raise ValueError(f"{ENV_SPEC}: {key} expects a number in {text!r}, got {value!r}") from None
        fault = Fault(action, text=text, **kw)  # type: ignore[arg-type]
        _check_node_fault(fault)
        faults.append(fault)
    return faults


NODE_POINTS = {"precheck": ("node-fail", "nan", "delay"), "node": ("delay",)}  # what the agent applies


def _check_node_fault(fault: Fault) -> None:
    """Faults at the agent's points must be ones it applies (a typo must not pass silently)."""
    allowed = NODE_POINTS.get(fault.at)
    if allowed is not None and fault.action not in allowed:
        raise ValueError(
            f"{ENV_SPEC}: {fault.text!r}: at={fault.at} takes "
            f"{' or '.join('slow' if a == 'delay' else a for a in allowed)}"
        )
    if fault.action in NODE and fault.at != "precheck":
        raise ValueError(f"{ENV_SPEC}: {fault.text!r}: node-fail applies at the precheck only")


_cache: tuple[str, list[Fault]] | None = None
_file_cache: tuple[str, int, list[Fault]] | None = None  # (path, mtime_ns, faults)


def reset_cache() -> None:
    global _cache, _file_cache
    _cache = _file_cache = None


def _file_faults(path: str) -> list[Fault]:
    """Faults from ``STALWART_CHAOS_FILE``; a bad line is reported once and skipped, never fatal."""
    global _file_cache
    if not path:
        return []
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return []
    if _file_cache is None or _file_cache[:2] != (path, mtime):
        faults = []
        for line in Path(path).read_text().splitlines():
            try:
                faults += parse(line)
            except ValueError as e:
                print(f"stalwart chaos: ignoring {path}: {e}", file=sys.stderr, flush=True)
        _file_cache = (path, mtime, faults)
    return _file_cache[2]


def due(point: str, step: int | None = None, rank: int | None = None) -> Fault | None:
    """The fault to fire now at ``point`` (claimed, so it will not fire again), or None.

    Cheap when neither ``STALWART_CHAOS`` nor ``STALWART_CHAOS_FILE`` is set: two dict lookups, read
    live (``runtime.chaos_now``) because the agent sets them in its own process after start.
    """
    global _cache
    spec, path = runtime.chaos_now()
    if spec and (_cache is None or _cache[0] != spec):
        _cache = (spec, parse(spec))
    for fault in (_cache[1] if spec and _cache else []) + _file_faults(path):
        if fault.matches(point, step, rank) and fault.claim():
            return fault
    return None
