"""The ElasticFlow-trace simulator: engine semantics on hand-made traces, and Fig. 8b reproduction on
the small published traces (cluster10, cluster01)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from stalwart.sched.elasticflow_place import Placement
from stalwart.sched.elasticflow_plan import Profile, plan_job
from stalwart.sched.elasticflow_sim import POLICIES, simulate
from stalwart.sched.elasticflow_trace import DEFAULT_DATA_ROOT as DATA
from stalwart.sched.elasticflow_trace import load_throughputs, load_trace, scaling
from stalwart.sched.sim_result import JobOutcome, SimResult

COLUMNS = ["job_id", "submission_time", "num_iteration", "model_name", "deadline", "batch_size", "num_gpu", "duration"]


def _data_root(tmp_path: Path) -> Path:
    """A data root holding one synthetic model whose throughput is linear in GPUs (10 it/s per GPU)."""
    (tmp_path / "throughputs_A100").mkdir()
    (tmp_path / "traces").mkdir()
    with open(tmp_path / "throughputs_A100" / "lin.csv", "w") as f:
        f.write("global_batch_size,1,2,4,8\n64,10,20,40,80\n")
    return tmp_path


def _trace(root: Path, rows: list[tuple[str, float, float, float, int]]) -> Path:
    """rows: (name, submit, iterations, deadline, num_gpu) of model ``lin`` at batch 64."""
    path = root / "traces" / "toy.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for name, submit, iters, deadline, gpus in rows:
            w.writerow([name, submit, iters, "lin", deadline, 64, gpus, iters / (10 * gpus)])
    return path


def _by_name(result: SimResult) -> dict[str, JobOutcome]:
    return {j.name: j for j in result.jobs}


def test_edf_runs_the_earlier_deadline_first(tmp_path: Path) -> None:
    root = _data_root(tmp_path)
    # One 8-GPU cluster; both jobs want all 8 GPUs (600 s of work alone); b's deadline is earlier.
    path = _trace(root, [("a", 0, 48000, 5000, 8), ("b", 0, 48000, 700, 8)])
    jobs = _by_name(simulate(path, "edf", gpus=8, data_root=root))
    assert jobs["b"].finish == pytest.approx(600)
    assert jobs["a"].finish == pytest.approx(1200)
    assert jobs["a"].met_deadline and jobs["b"].met_deadline


def test_elasticflow_drops_an_infeasible_job_at_admission(tmp_path: Path) -> None:
    root = _data_root(tmp_path)
    # "late" needs 10 000 s even on all 8 GPUs but has 1 000 s: declined, counts as a miss, uses no GPU.
    # (It arrives in a later round: ElasticFlow declines a whole batch of simultaneous arrivals.)
    path = _trace(root, [("ok", 0, 4000, 3000, 1), ("late", 10, 800000, 1000, 1)])
    result = simulate(path, "elasticflow", gpus=8, data_root=root)
    jobs = _by_name(result)
    assert jobs["late"].finish is None and jobs["late"].gpu_seconds == 0
    assert jobs["ok"].met_deadline
    assert result.summary()["dsr"] == pytest.approx(0.5)
    assert result.extra["dropped"] == 1


def test_elasticflow_accounts_completion_like_its_simulator(tmp_path: Path) -> None:
    root = _data_root(tmp_path)
    # Alone, "a" gets all 8 GPUs (80 it/s): planned end ceil(4000 / 80) = 50 s. ElasticFlow's simulator
    # records that planned end even though the round also paid 10 s of overhead (2 s + a cache miss):
    # the job leaves at its end event, 60 s + 10 s, when nothing else happens first.
    alone = _trace(root, [("a", 0, 4000, 3000, 1)])
    assert _by_name(simulate(alone, "elasticflow", gpus=8, data_root=root))["a"].finish == pytest.approx(50)
    # "b" arrives at 20 s (a round at 60 s, before a's end event): a ran only 50 - 10 = 40 s of the first
    # round and still has 800 iterations left, which it finishes after 60 s on 4 GPUs (ceil(800/40) = 20 s).
    busy = _trace(root, [("a", 0, 4000, 3000, 1), ("b", 20, 800, 3000, 1)])
    assert _by_name(simulate(busy, "elasticflow", gpus=8, data_root=root))["a"].finish == pytest.approx(80)


def test_deadline_accounting_counts_late_finishes_as_misses(tmp_path: Path) -> None:
    root = _data_root(tmp_path)
    # FIFO at trace sizes: the second job waits ~1 000 s for the first and misses its 1 500 s deadline.
    # Starting costs ElasticFlow's modelled launch overhead: 2 s + 2 s * (log2(8) + 1) = 10 s.
    path = _trace(root, [("first", 0, 80000, 1100, 8), ("second", 10, 40000, 1500, 8)])
    result = simulate(path, "fifo", gpus=8, data_root=root)
    jobs = _by_name(result)
    assert jobs["first"].finish == pytest.approx(1010) and jobs["first"].met_deadline
    assert jobs["second"].finish > 1500 and not jobs["second"].met_deadline
    assert result.summary()["dsr"] == pytest.approx(0.5)


def test_minimum_satisfactory_share_prefers_fewer_gpus() -> None:
    prof = Profile(0.0, 8)
    sc = scaling(DATA, "bert", 64, 8, 8)
    one_gpu_rate = float(sc.rate[1])
    plan = plan_job(prof, sc, iters=one_gpu_rate * 1000, deadline=1000.0)
    assert plan is not None and plan.feasible and plan.alloc_now == 1 and plan.finish == pytest.approx(1000)
    assert prof.free[0] == 7  # the rest stays free for others
    assert plan_job(prof, sc, iters=float(sc.rate[8]) * 2000, deadline=1000.0) is None


def test_placement_cache_is_keyed_by_rank_range_not_by_job() -> None:
    pl = Placement(32, switches=1)  # 4 nodes of 8 GPUs
    assert pl.round([], [(0, 8), (1, 4), (2, 2), (3, 2)]) == {0: False, 1: False, 2: False, 3: False}
    # same layout next round: every range is cached
    assert pl.round([0, 1, 2, 3], [(0, 8), (1, 4), (2, 2), (3, 2)]) == dict.fromkeys(range(4), True)
    # jobs 0, 2, 3 leave, job 4 arrives with 8 GPUs: it gets job 0's old ranks 0-7 (cached); with the
    # 2-GPU jobs gone job 1 still starts at rank 8
    assert pl.round([0, 1, 2, 3], [(4, 8), (1, 4)]) == {4: True, 1: True}
    assert pl.round([1, 4], [(1, 4)]) == {1: False}  # alone, job 1 moves to ranks 0-3
    pl.restart()
    assert pl.round([1], [(1, 4)]) == {1: False}


def test_placement_interleaves_switches_once_nodes_come_back() -> None:
    pl = Placement(32, switches=2)  # 2 switches x 2 nodes; ranks go switch by switch
    pl.round([], [(0, 8), (1, 8)])  # first round: nodes in switch order (ranks 0 and 8)
    # released nodes go to the back, then the free list is stably sorted by per-switch node id:
    # s1n0, s0n0, s1n1, s0n1; job 0 lands on s1n0 (ranks 16-23, new), job 1 on s0n0 (ranks 0-7, cached)
    assert pl.round([0, 1], [(0, 8), (1, 8)]) == {0: False, 1: True}
    assert sorted(pl.cache) == [(0, 8), (8, 8), (16, 8)]


def test_stalwart_pays_restart_cost_per_reallocation(tmp_path: Path) -> None:
    root = _data_root(tmp_path)
    path = _trace(root, [("a", 0, 400000, 20000, 1), ("b", 500, 40000, 4000, 1)])
    cheap = simulate(path, "stalwart", gpus=8, data_root=root, restart_cost_s=0.0)
    dear = simulate(path, "stalwart", gpus=8, data_root=root, restart_cost_s=100.0)
    assert cheap.reallocations >= 1  # b's arrival takes GPUs from a
    assert _by_name(dear)["a"].finish > _by_name(cheap)["a"].finish


def test_bad_inputs_raise_actionable_errors(tmp_path: Path) -> None:
    root = _data_root(tmp_path)
    with pytest.raises(ValueError, match="no ElasticFlow trace"):
        simulate("nope", "edf", data_root=root)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(_trace(root, [("a", 0, 10, 100, 1)]), "sjf", gpus=8, data_root=root)
    with pytest.raises(ValueError, match="unknown model"):
        load_throughputs(root, "alexnet")
    with pytest.raises(ValueError, match="cluster size"):
        simulate(_trace(root, [("a", 0, 10, 100, 1)]), "edf", data_root=root)


def test_deterministic() -> None:
    a = simulate("cluster10", "stalwart", data_root=DATA, seed=1).summary()
    b = simulate("cluster10", "stalwart", data_root=DATA, seed=1).summary()
    assert a == b


def test_trace_loader_reads_the_published_trace() -> None:
    jobs = load_trace("cluster10", DATA)
    assert len(jobs) == 260 and all(j.deadline > j.submit for j in jobs)
    assert [j.submit for j in jobs] == sorted(j.submit for j in jobs)


PAPER = {  # Fig. 8b, plot_fig8b.py: (cluster01, cluster10)
    "elasticflow": (0.788, 0.981),
    "tiresias": (0.478, 0.473),
    "edf": (0.182, 0.769),
}


@pytest.mark.parametrize("policy", sorted(PAPER))
def test_reproduces_fig8b_on_cluster10(policy: str) -> None:
    dsr = simulate("cluster10", policy, data_root=DATA).summary()["dsr"]
    assert dsr == pytest.approx(PAPER[policy][1], abs=0.05)


def test_elasticflow_matches_the_published_simulator_on_cluster10() -> None:
    # ElasticFlow's own simulator (commit 04a0109, run_fig8b.sh settings) gives 250/260 = 0.962 here.
    dsr = simulate("cluster10", "elasticflow", data_root=DATA).summary()["dsr"]
    assert dsr == pytest.approx(250 / 260, abs=0.01)


def test_stalwart_at_least_matches_elasticflow_on_cluster10() -> None:
    ours = simulate("cluster10", "stalwart", data_root=DATA).summary()["dsr"]
    ef = simulate("cluster10", "elasticflow", data_root=DATA).summary()["dsr"]
    assert ours >= ef
    assert set(POLICIES) >= {"elasticflow", "edf", "tiresias", "fifo", "stalwart"}


@pytest.mark.parametrize("policy", ["edf", "tiresias"])
def test_reproduces_fig8b_on_cluster01(policy: str) -> None:
    # ElasticFlow itself is left out here: our cluster01 run lands +0.10 above the paper, and the
    # published ElasticFlow code itself gives 0.848 there (docs/sim_elasticflow.md).
    dsr = simulate("cluster01", policy, data_root=DATA).summary()["dsr"]
    assert dsr == pytest.approx(PAPER[policy][0], abs=0.05)
