"""The Pollux-workload cluster simulator (stalwart.sched.pollux_sim) on hand-made workloads, and its
reproduction of Pollux (OSDI'21) Fig. 8a cells on the artifact's workloads (shipped package data)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy")
from stalwart.sched.goodput import efficiency
from stalwart.sched.pollux_alloc import greedy, nodes_needed
from stalwart.sched.pollux_goodput import gain
from stalwart.sched.pollux_sim import POLICIES, fixed_batch_config, simulate
from stalwart.sched.pollux_workload import DEFAULT_ROOT as DATA
from stalwart.sched.pollux_workload import load_application, load_workload

HEADER = "name,time,application,num_replicas,batch_size\n"


def _csv(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "w.csv"
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


def _solo_seconds(app_name: str, replicas: int, batch: int) -> float:
    """Training time of one job alone on a packed placement, summed epoch by epoch from the traces."""
    app = load_application(DATA, app_name)
    atomic, accum = fixed_batch_config(app, batch, replicas)
    placement = tuple(min(4, replicas - i) for i in range(0, replicas, 4))
    step, sync = app.step_time(placement, atomic)
    real = replicas * atomic * (accum + 1)
    total = 0.0
    for epoch in range(app.max_epochs):
        sqr, var = app.grad_stats(real, epoch)
        per_step = (var + sqr) / (var * app.init_batch_size / real + sqr)
        total += (app.progress_at(epoch + 1) - app.progress_at(epoch)) * (step + (step - sync) * accum) / per_step
    return total


def test_a_lone_job_takes_its_wait_plus_restart_plus_work_over_throughput(tmp_path: Path):
    path = _csv(tmp_path, ["c,10,cifar10,4,512"])
    for restart in (0.0, 30.0):
        result = simulate(path, "fifo", data_root=DATA, restart_cost_s=restart)
        (job,) = result.jobs
        expected = (60 - 10) + restart + _solo_seconds("cifar10", 4, 512)  # first decision at t = 60 s
        assert job.jct == pytest.approx(expected, rel=1e-9)
        assert job.gpu_seconds == pytest.approx(4 * (expected - 50), rel=1e-9)
    assert result.reallocations == 0 and result.summary()["finished"] == 1


def test_fifo_runs_jobs_in_arrival_order_and_a_blocked_head_holds_back_the_rest(tmp_path: Path):
    path = _csv(tmp_path, ["a,0,cifar10,64,4096", "b,1,bert,64,384", "c,2,ncf,1,32768"])
    jobs = {j.name: j for j in simulate(path, "fifo", data_root=DATA, restart_cost_s=0).jobs}
    assert jobs["a"].finish < jobs["b"].finish < jobs["c"].finish
    # b needs the whole cluster, so it starts at the first decision after a ends, and c (which would
    # fit beside a) still waits for b: no backfilling.
    assert jobs["b"].finish - jobs["a"].finish >= _solo_seconds("bert", 64, 384)
    assert jobs["c"].finish - jobs["b"].finish >= _solo_seconds("ncf", 1, 32768)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_finishes_every_job_and_is_deterministic(tmp_path: Path, policy: str):
    rows = (DATA / "workloads" / "workload-1.csv").read_text().splitlines()[1:25]
    path = _csv(tmp_path, rows)
    first, second = (simulate(path, policy, data_root=DATA, seed=3) for _ in range(2))
    assert first.summary()["finished"] == 24
    assert [j.finish for j in first.jobs] == [j.finish for j in second.jobs]
    assert first.reallocations == second.reallocations
    assert all(j.gpu_seconds > 0 for j in first.jobs)


def test_node_packing_and_greedy_allocation():
    assert nodes_needed([3, 3, 3, 3, 1, 1, 1, 1]) == 4
    assert nodes_needed([2, 2, 2, 1, 1]) == 2
    assert nodes_needed([8, 4, 1]) == 4
    counts = np.array([0, 1, 2, 3, 4, 8])
    # job 0 gains a lot from 8 GPUs (but nothing from fewer), job 1 saturates at 1: with two nodes
    # the greedy must look past the flat start of job 0's curve.
    cost = np.array([[10.0, 9.9, 9.8, 9.7, 9.6, 1.0], [10.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    assert counts[greedy(cost, counts, nodes=3)].tolist() == [8, 1]
    assert counts[greedy(cost, counts, nodes=2)].tolist() == [4, 1]


def test_gain_is_scale_times_pollux_efficiency():
    for scale in (1.0, 2.5, 16.0):
        assert gain(np.array([scale]), 3.0, 7.0)[0] == pytest.approx(scale * efficiency(scale * 64, 64, 3.0, 7.0))


def test_bad_input_is_rejected_with_an_actionable_message(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(1, "drf", data_root=DATA)
    with pytest.raises(ValueError, match="no workload"):
        simulate(9, "fifo", data_root=DATA)
    with pytest.raises(ValueError, match="need columns"):
        load_workload(_csv(tmp_path, ["x,zero,cifar10,1,128"]))
    with pytest.raises(ValueError, match="no Pollux traces"):
        simulate(_csv(tmp_path, ["x,0,gpt9,1,128"]), "fifo", data_root=DATA)
    with pytest.raises(ValueError, match="multiple of 4"):
        simulate(1, "fifo", data_root=DATA, gpus=6)


@pytest.fixture(scope="module")
def fig8a() -> dict[str, dict[int, float]]:
    return {
        p: {
            int(k[-1]): v
            for k, v in json.loads((DATA / f"results-jobload/{p}-1.0/summary.json").read_text())["avgs"].items()
        }
        for p in ("pollux", "optimus", "tiresias")
    }


def test_workload_3_reproduces_fig8a_within_15_percent_and_in_order(fig8a: dict[str, dict[int, float]]):
    # Workload 3 has the closest published pair (Tiresias 3876 s vs Optimus 3944 s): order is a real test.
    ours = {p: simulate(3, p, data_root=DATA).summary()["avg_jct_s"] for p in fig8a}
    for policy, jct in ours.items():
        assert jct == pytest.approx(fig8a[policy][3], rel=0.15), policy
    assert sorted(ours, key=ours.__getitem__) == sorted(fig8a, key=lambda p: fig8a[p][3])


def test_stalwart_policy_is_at_most_5_percent_worse_than_pollux_on_workload_1(fig8a: dict[str, dict[int, float]]):
    pollux = simulate(1, "pollux", data_root=DATA).summary()["avg_jct_s"]
    stalwart = simulate(1, "stalwart", data_root=DATA).summary()["avg_jct_s"]
    assert pollux == pytest.approx(fig8a["pollux"][1], rel=0.15)
    assert stalwart <= 1.05 * pollux
