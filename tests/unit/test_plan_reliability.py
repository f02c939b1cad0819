"""Reliability: failure odds, MTBF, Young/Daly intervals, ETTR (hand-derived values)."""

import math

import pytest

from stalwart.plan.reliability import (
    Policy,
    compare_policies,
    daly_interval,
    ettr,
    ettr_two_tier,
    job_mtbf_hours,
    p_any_failure,
    young_interval,
)


def test_seed_failure_odds():
    assert p_any_failure(0.001, 8) == pytest.approx(0.008, abs=0.0005)  # seed: 0.8 %
    assert p_any_failure(0.001, 10_000) > 0.9999  # seed: 99.99 %
    assert p_any_failure(0.001, 0) == 0.0


def test_mtbf_from_rates():
    # per-GPU daily probability p → rate -ln(1-p)/24 per hour; rates add over GPUs
    assert job_mtbf_hours(8, p_gpu_day=0.001) == pytest.approx(24 / (8 * -math.log(0.999)))
    assert job_mtbf_hours(1000, gpu_mtbf_hours=1e6) == pytest.approx(1000)
    assert job_mtbf_hours(800, gpu_mtbf_hours=8e5, n_nodes=100, node_mtbf_hours=1e4) == pytest.approx(1 / (1e-3 + 1e-2))
    with pytest.raises(ValueError, match="failure rate"):
        job_mtbf_hours(8)
    with pytest.raises(ValueError, match="probability"):
        job_mtbf_hours(8, p_gpu_day=1.5)


def test_young_and_daly():
    assert young_interval(60, 3600) == pytest.approx(math.sqrt(2 * 60 * 3600))
    # Daly 2006 by hand for δ = 60 s, M = 1 h: x = δ/2M = 1/120
    x = 1 / 120
    assert daly_interval(60, 3600) == pytest.approx(math.sqrt(7200 * 60) * (1 + math.sqrt(x) / 3 + x / 9) - 60)
    assert daly_interval(10_000, 3600) == 3600  # δ ≥ 2M: checkpoint once per MTBF


def test_ettr_limits_and_optimum():
    # no failures: only the checkpoint stall is lost
    assert ettr(3600, 60, 600, 1e15) == pytest.approx(3600 / 3660, rel=1e-6)
    # Daly's interval maximises his own ETTR expression (within a few percent of the numeric best)
    delta, m = 30.0, 4 * 3600.0
    grid = [10 * i for i in range(1, 2000)]
    best = max(grid, key=lambda t: ettr(t, delta, 300, m))
    assert daly_interval(delta, m) == pytest.approx(best, rel=0.05)
    assert ettr(daly_interval(delta, m), delta, 300, m) >= ettr(3 * 3600, delta, 300, m)


def test_two_tier_and_policies():
    # all failures from storage, no snapshot cost: first-order single-tier loss
    e = ettr_two_tier(60, 0, 0, 3600, 60, 600, 86400, fast_recoverable=0.0)
    assert e == pytest.approx((1 / (1 + 60 / 3600)) * (1 - (1830 + 600) / 86400))
    rows = compare_policies(
        [Policy("disk 3h", 10800, 60, 600), Policy("disk + memory", 10800, 60, 600, 60, 1, 60, 0.9)], 86400, 30
    )
    assert [r["name"] for r in rows] == ["disk + memory", "disk 3h"]
    assert rows[0]["wall_days"] == pytest.approx(30 / rows[0]["ettr"])
