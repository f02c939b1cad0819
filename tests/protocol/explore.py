"""The protocol explorer: runs one simulated job (``sim.World``) per seed under a deterministic scheduler
— a seeded choice of the next enabled action, a fault now and then from a per-schedule budget — and
checks the invariants on every schedule (docs/protocol.md). A failing schedule names its seed and the
one command that replays it with a trace:

    PYTHONPATH=src python -m tests.protocol.explore --seed 123 --variant new --trace
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from dataclasses import dataclass, field

from tests.protocol.invariants import Violation
from tests.protocol.old_design import VARIANTS, Timeout
from tests.protocol.sim import TICK_S, World

MAX_STEPS = 4000  # a schedule that has not ended by then is a livelock
FAULT_P = 0.06  # the chance that the next action is a fault, while the schedule's budget lasts
BOUNDED_WAIT_S = 1.0  # a timer jump longer than this is a wait no event ended


@dataclass
class Outcome:
    seed: int
    variant: str
    skew: float
    violation: str | None
    steps: int
    faults: list[str]
    trace: list[str] = field(default_factory=list)
    saved: bool = False  # a save-on-failure committed
    restarted: int = 0
    from_copies: bool = False  # shards written from a peer's copy (a lost node's ranks)

    def replay(self) -> str:
        skew = f" --skew {self.skew}" if self.skew else ""
        cmd = "PYTHONPATH=src python -m tests.protocol.explore"
        return f"{cmd} --seed {self.seed} --variant {self.variant}{skew} --trace"


def run(seed: int, variant: str = "new", skew: float = 0.0, keep_trace: bool = False) -> Outcome:
    rng = random.Random(seed)
    world = World(
        n_nodes=rng.choice((2, 2, 3)),
        per_node=rng.choice((1, 2)),
        steps=rng.choice((4, 6, 8)),
        every=2,
        restarts=rng.choice((1, 2)),
        rules=VARIANTS[variant],
        skew=skew,
    )
    budget = rng.choice((0, 1, 2, 2, 3))
    faults: list[str] = []
    trace: list[str] = []
    violation = None
    step = 0
    try:
        for step in range(MAX_STEPS):  # noqa: B007 (reported)
            acts = world.actions(False)
            if budget and acts and rng.random() < FAULT_P and (fault_acts := world.fault_actions()):
                kind = rng.choice(sorted({a[0] for a in fault_acts}))  # each kind as likely as another
                acts, budget = [a for a in fault_acts if a[0] == kind], budget - 1
            if not acts:
                if not world.timers:
                    world.check_end()
                    break
                world.timers.sort()
                at, token = world.timers.pop(0)
                if at - world.now > BOUNDED_WAIT_S:
                    raise Violation(f"a wait of {at - world.now:.0f} s ended only by a timer ({token}), no event")
                world.now = at
                world.decide(Timeout(token))
                continue
            name, fn, args = acts[rng.randrange(len(acts))]
            if name in _FAULTS:
                faults.append(f"{name}{args}")
            if keep_trace:
                trace.append(f"{world.now:7.2f} e{world.epoch} {name}{args}")
            fn(*args)
            world.now += TICK_S
        else:
            raise Violation(f"no end within {MAX_STEPS} steps (a wait without a bound)")
        if not faults and (lost := [g for g in world.given_up if g[0] not in world.busy]):
            raise Violation(f"a schedule without faults gave a due step up: step {lost[0][0]}: {lost[0][1]}")
    except Violation as err:
        violation = str(err)
    if keep_trace:
        trace.extend(world.decider.log)
    saved, copied = world.saved_on_failure > 0, world.from_copies > 0
    return Outcome(seed, variant, skew, violation, step, faults, trace, saved, world.epoch, copied)


_FAULTS = {
    "kill-rank-mid-copy",
    "kill-keeper",
    "lose-node",
    "storage-fails",
    "duplicate",
    "commit-fails",
    "preempt",
}


def explore(
    seeds: range, variant: str = "new", skew: float = 0.0, stop_at: str | None = None
) -> tuple[list[Outcome], Counter]:
    """Run every seed; the violations, and how often each fault and outcome came up (coverage).
    ``stop_at``: stop at the first violation that says this (one rule may break several invariants)."""
    bad: list[Outcome] = []
    seen: Counter = Counter()
    for seed in seeds:
        out = run(seed, variant, skew)
        seen["schedules"] += 1
        seen["restarted"] += out.restarted > 0
        seen["saved on failure"] += out.saved
        seen["written from copies"] += out.from_copies
        for f in out.faults:
            seen[f.split("(")[0]] += 1
        if out.violation:
            bad.append(out)
            if stop_at is not None and stop_at in out.violation:
                break
    return bad, seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=1, help="seeds from --seed on")
    p.add_argument("--variant", default="new", choices=sorted(VARIANTS))
    p.add_argument("--skew", type=float, default=0.0, help="participant clocks ahead of rank 0's node (s)")
    p.add_argument("--trace", action="store_true")
    a = p.parse_args()
    if a.trace:
        out = run(a.seed, a.variant, a.skew, keep_trace=True)
        print("\n".join(out.trace))
        verdict = out.violation or "no violation"
        print(f"seed {a.seed} [{a.variant}]: {verdict} after {out.steps} steps; faults {out.faults}")
        sys.exit(1 if out.violation else 0)
    bad, seen = explore(range(a.seed, a.seed + a.count), a.variant, a.skew)
    print(dict(seen))
    for out in bad[:10]:
        print(f"seed {out.seed}: {out.violation}\n  replay: {out.replay()}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
