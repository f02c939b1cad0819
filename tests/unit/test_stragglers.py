"""Per-section straggler scores: a rank 1.3× slower in forward is flagged within 20 steps; 200 clean
steps flag nobody, also with a busy host's bursts of noise; ranks that only wait for the slow one are
not flagged; pipeline stages are judged against their own stage."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.observe.stragglers import _median_without, scores


def _steps(
    n: int, slow: dict[int, float], seed: int, start: int = 1, ranks: int = 4, bursts: float = 0.0
) -> list[dict]:
    """Ranks in lockstep: forward ~ 100 ms ± 8 % noise (× the rank's slowdown); every rank's backward
    waits for the slowest forward of the step. ``bursts``: the chance per step that one random rank
    starts a burst of 2–8 steps at 1.5× (another process on its core), or the whole host one at 2×."""
    rng = random.Random(seed)
    out, burst = [], {}
    for step in range(start, start + n):
        if rng.random() < bursts:
            for r in [rng.randrange(ranks)] if rng.random() < 0.7 else range(ranks):
                burst[r] = (step + rng.randint(2, 8), 1.5 if len(burst) < ranks else 2.0)
        factor = {r: f for r, (until, f) in burst.items() if step < until}
        forward = {r: 100.0 * slow.get(r, 1.0) * factor.get(r, 1.0) * rng.uniform(0.92, 1.08) for r in range(ranks)}
        done = max(forward.values())
        for r in range(ranks):
            ms = {"data": rng.uniform(1, 2), "forward": forward[r], "backward": 50.0 + done - forward[r]}
            out.append({"step": step, "rank": r, "time": float(step), "ms": ms})
    return out


def _false_flags(records: list[dict], **kw) -> list[int]:
    """The steps (judged every 5, as the run goes) at which anyone was flagged."""
    return [end for end in range(10, 201, 5) if scores([r for r in records if r["step"] <= end], **kw)["flagged"]]


def test_no_false_flag_in_200_clean_steps():
    assert _false_flags(_steps(200, {}, seed=1)) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_busy_hosts_bursts_of_noise_flag_nobody_as_they_would_in_a_single_window(ranks):
    records = _steps(200, {}, seed=4, ranks=ranks, bursts=0.03)
    assert _false_flags(records) == []
    assert _false_flags(records, persist=1), "the bursts are strong enough to flag a single window"
    # and over many runs of a busier host: persistence removes ≥ 90 % of a single window's false flags
    runs = [_steps(200, {}, seed=s, ranks=ranks, bursts=0.06) for s in range(10)]
    assert 10 * sum(len(_false_flags(r)) for r in runs) <= sum(len(_false_flags(r, persist=1)) for r in runs)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_slowed_in_forward_is_flagged_within_20_steps_and_waiters_are_not(ranks):
    records = _steps(50, {}, seed=2, ranks=ranks) + _steps(20, {1: 1.3}, seed=3, start=51, ranks=ranks)
    assert scores(records[: 60 * ranks])["flagged"] == {}, "one slow window is not enough"
    result = scores(records)
    assert result["flagged"] == {1: ["forward"]}
    scored = result["ranks"]
    assert scored[1]["forward"]["peer"] >= 1.2 and scored[1]["forward"]["self"] >= 1.2
    others = [r for r in range(ranks) if r != 1]
    assert all(scored[r]["backward"]["peer"] > scored[1]["backward"]["peer"] for r in others), "they wait"


def test_pipeline_stages_are_judged_against_their_own_stage():
    # dp2 × pp2: stage 1 (ranks 2, 3: the loss and the head) always takes 1.5× stage 0's forward
    records = _steps(40, {2: 1.5, 3: 1.5}, seed=5)
    stages = {0: 0, 1: 0, 2: 1, 3: 1}
    assert scores(records)["flagged"], "against every rank, a whole stage looks slow"
    assert scores(records, groups=stages)["flagged"] == {}
    records = _steps(40, {2: 1.5, 3: 1.5 * 1.3}, seed=6)
    assert scores(records, groups=stages)["flagged"] == {3: ["forward"]}


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="window and persist must be ≥ 1"):
        scores([], window=0)


@given(st.lists(st.sampled_from([1.0, 2.0, 3.0, 0.5, 7.25]), min_size=1, max_size=9), st.data())
def test_a_ranks_peers_median_leaves_out_exactly_the_rank(values, data):
    values.sort()
    mine = data.draw(st.sampled_from(values))
    rest = list(values)
    rest.remove(mine)
    assert _median_without(values, mine) == (statistics.median(rest) if rest else None)
