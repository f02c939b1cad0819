"""ETTR simulation (`stalwart plan simulate`): agrees with the planner's closed forms where both
apply, reproduces the published failure figures, and is deterministic under a seed."""

from __future__ import annotations

import json

import pytest

from stalwart.cli import main
from stalwart.plan import ettr_study, failures, reliability
from stalwart.plan.simulate import Job, RecoveryPolicy, run, simulate


def _policy(**kw: float) -> RecoveryPolicy:
    base = {"detect_s": 0.0, "restart_s": 0.0, "replace_node_s": 0.0, "restore_storage_s": 0.0}
    return RecoveryPolicy("p", **{**base, **kw})


@pytest.mark.parametrize(
    ("mtbf_h", "interval_s", "stall_s", "restart_s"),
    [(3.0, 1800.0, 60.0, 600.0), (0.5, 600.0, 30.0, 300.0), (24.0, 7200.0, 120.0, 900.0)],
)
def test_agrees_with_dalys_ettr_within_two_points(mtbf_h, interval_s, stall_s, restart_s):
    got = ettr_study.analytic_check(mtbf_h, interval_s, stall_s, restart_s, runs=5)
    assert got["analytic"] == reliability.ettr(interval_s, stall_s, restart_s, mtbf_h * 3600)
    assert abs(got["simulated"] - got["analytic"]) < 0.02, got


def test_agrees_with_the_planners_two_tier_ettr_within_two_points():
    mtbf_h, recoverable = 3.0, 0.8
    classes = [
        failures.FailureClass("process", recoverable / mtbf_h, "job"),
        failures.FailureClass("node", (1 - recoverable) / mtbf_h, "job", evicts_node=True),
    ]
    pol = _policy(
        storage_every_s=3600,
        storage_stall_s=60,
        restore_storage_s=600,
        snapshot_every_s=60,
        snapshot_stall_s=1,
        restore_memory_s=30,
    )
    analytic = reliability.ettr_two_tier(60, 1, 30, 3600, 60, 600, mtbf_h * 3600, recoverable)
    assert abs(run(Job(8, 365), classes, pol, runs=5)["ettr"] - analytic) < 0.02


def test_llama3_interruptions_and_ettr_are_reproduced():
    pub = failures.PUBLISHED["llama3"]
    result = run(Job(pub["gpus"], pub["days"]), failures.preset("llama3"), ettr_study.policies()["checkpoint-restart"])
    assert abs(result["failures"] - pub["interruptions"]) / pub["interruptions"] < 0.15, result
    assert result["by_class"]["gpu"] > result["by_class"]["software"] > result["by_class"]["network"]
    assert pub["ettr_min"] < result["ettr"] < 0.97, result


@pytest.mark.parametrize(("gpus", "mttf_h"), [(1024, 7.9), (16384, 1.8)])
def test_meta_cluster_study_mttf_is_reproduced_within_15_percent(gpus, mttf_h):
    result = run(Job(gpus, 60), failures.preset("meta-rsc"), ettr_study.policies()["stalwart"], runs=10)
    assert abs(result["mttf_hours"] - mttf_h) / mttf_h < 0.15, result


def test_same_seed_same_answer_and_seeds_differ():
    job, classes, pol = Job(16384, 10), failures.preset("llama3"), ettr_study.policies()["stalwart"]
    assert simulate(job, classes, pol, seed=7) == simulate(job, classes, pol, seed=7)
    assert simulate(job, classes, pol, seed=7) != simulate(job, classes, pol, seed=8)


def test_node_losses_cost_stalwart_storage_restores_that_peer_replicas_avoid():
    """At 100k GPUs most failures evict a node, whose memory snapshots go with it."""
    job, classes, pols = Job(100_000, 10), failures.preset("llama3"), ettr_study.policies()
    got = {name: run(job, classes, pol, runs=5) for name, pol in pols.items()}
    assert got["checkpoint-restart"]["ettr"] < got["stalwart"]["ettr"] < got["stalwart+replicas"]["ettr"]
    assert got["stalwart+replicas"]["lost_work_hours"] < got["stalwart"]["lost_work_hours"] / 5


def test_running_out_of_spares_waits_for_repairs():
    classes = [failures.FailureClass("gpu", 1 / 2.0, "job", evicts_node=True)]
    pol = ettr_study.policies()["stalwart"]
    plenty = run(Job(1024, 20), classes, pol, runs=3)
    scarce = run(Job(1024, 20, spares=1, repair_hours=12), classes, pol, runs=3)
    assert plenty["waited_for_spares_hours"] == 0 and scarce["waited_for_spares_hours"] > 24
    assert scarce["ettr"] < plenty["ettr"] - 0.1


def test_bad_inputs_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="unknown failure preset 'nope'; choose one of llama3, meta-rsc"):
        failures.preset("nope")
    with pytest.raises(ValueError, match="storage_every_s must be positive"):
        _policy(storage_every_s=0, storage_stall_s=1)
    with pytest.raises(ValueError, match="spares must be >= 0"):
        Job(8, 1, spares=-1)


def test_cli_one_job_as_json(capsys):
    assert main(["plan", "simulate", "--gpus", "16384", "--sim-days", "5", "--runs", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == list(ettr_study.policies())
    assert all(0 < r["ettr"] <= 1 and r["gpus"] == 16384 for r in out["results"])


def test_cli_study_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install 'stalwart[plot]')")
    png = tmp_path / "ettr.png"
    assert main(["plan", "simulate", "--runs", "2", "--sim-days", "5", "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(out["predictions"]) == {"16384", "100000"} and out["byterobust"]["published_ettr"] == 0.97
