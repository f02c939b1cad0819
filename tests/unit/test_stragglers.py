"""Per-section straggler scores: a rank 1.3× slower in forward is flagged within 20 steps; 200 clean
steps flag nobody; ranks that only wait for the slow one are not flagged."""

from __future__ import annotations

import random

from stalwart.observe.stragglers import scores


def _steps(n: int, slow: dict[int, float], seed: int, start: int = 1) -> list[dict]:
    """Four ranks in lockstep: forward ~ 100 ms ± 8 % noise (× the rank's slowdown); every rank's
    backward waits for the slowest forward of the step."""
    rng = random.Random(seed)
    out = []
    for step in range(start, start + n):
        forward = {r: 100.0 * slow.get(r, 1.0) * rng.uniform(0.92, 1.08) for r in range(4)}
        done = max(forward.values())
        for r in range(4):
            ms = {"data": rng.uniform(1, 2), "forward": forward[r], "backward": 50.0 + done - forward[r]}
            out.append({"step": step, "rank": r, "time": float(step), "ms": ms})
    return out


def test_no_false_flag_in_200_clean_steps():
    records = _steps(200, {}, seed=1)
    for end in range(10, 201, 5):  # judged as the run goes, every 5 steps
        seen = [r for r in records if r["step"] <= end]
        assert scores(seen)["flagged"] == {}, f"false flag at step {end}"


def test_a_rank_slowed_in_forward_is_flagged_within_20_steps_and_waiters_are_not():
    records = _steps(50, {}, seed=2) + _steps(20, {2: 1.3}, seed=3, start=51)
    result = scores(records)
    assert result["flagged"] == {2: ["forward"]}
    ranks = result["ranks"]
    assert ranks[2]["forward"]["peer"] >= 1.2 and ranks[2]["forward"]["self"] >= 1.2
    assert all(ranks[r]["backward"]["peer"] > ranks[2]["backward"]["peer"] for r in (0, 1, 3)), "they wait"
