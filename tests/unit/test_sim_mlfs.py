"""The learned scheduler (``mlfs``) and its greedy baseline (``hypersched``): training is reproducible
under a seed, a resumed training equals an uninterrupted one, no output over-allocates the cluster, and
``stalwart sim`` lists both and evaluates them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from stalwart.cli import main
from stalwart.sched.hypersched import HyperSched
from stalwart.sched.mlfs_env import RUNGS, Window, grant, load_jobs, run_episode
from stalwart.sched.mlfs_policy import Greedy, Sampler, make_net
from stalwart.sched.mlfs_train import TrainConfig, load_policy, train
from stalwart.sched.pollux_sim import NODES_GPUS
from stalwart.sched.pollux_workload import DEFAULT_ROOT

TINY = dict(episodes=3, imitation_episodes=1, imitation_steps=5, window_jobs=4, train_workloads=(1,))


def _weights(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def test_training_is_deterministic_under_a_seed_and_moves_the_weights():
    a = train(TrainConfig(seed=3, **TINY))
    b = train(TrainConfig(seed=3, **TINY))
    c = train(TrainConfig(seed=4, **TINY))
    assert a.curve == b.curve and all(torch.equal(x, y) for x, y in zip(_weights(a.net), _weights(b.net)))
    assert not all(torch.equal(x, y) for x, y in zip(_weights(a.net), _weights(c.net))), "the seed matters"
    untrained = _weights(make_net(3))
    assert not all(torch.equal(x, y) for x, y in zip(_weights(a.net), untrained)), "training changed nothing"
    assert [c["phase"] for c in a.curve] == ["imitation", "rl", "rl"]
    assert a.curve[0]["ratio"] == 1.0, "the imitation phase runs the greedy policy itself"
    cost = a.report()["exploration_cost"]
    assert cost["learning_episodes"] == 2
    rl = [c for c in a.curve if c["phase"] == "rl"]
    assert cost["extra_jct_job_hours"] == pytest.approx(sum(c["jct_h"] - c["greedy_jct_h"] for c in rl), abs=2e-3)


def test_resuming_from_the_checkpoint_equals_training_without_a_break(tmp_path):
    path = tmp_path / "mlfs.pt"
    whole = train(TrainConfig(seed=1, **TINY))
    first = train(TrainConfig(seed=1, **(TINY | {"episodes": 2})), checkpoint=path)
    assert first.episodes_done == 2 and path.exists()
    state = torch.load(path, weights_only=True)  # the format loads without unpickling code
    assert len(state["curve"]) == 2
    resumed = train(TrainConfig(seed=1, **TINY), checkpoint=path)
    assert resumed.curve == whole.curve
    assert all(torch.equal(x, y) for x, y in zip(_weights(resumed.net), _weights(whole.net)))
    assert all(torch.equal(x, y) for x, y in zip(_weights(load_policy(path)), _weights(whole.net)))
    with pytest.raises(ValueError, match="other settings"):
        train(TrainConfig(seed=2, **TINY), checkpoint=path)


class _Checked:
    """Wraps a chooser: before each decision, the allocation in force fits the cluster and its nodes."""

    def __init__(self, inner, gpus: int) -> None:
        self.inner, self.gpus, self.calls = inner, gpus, 0

    def __call__(self, now, jobs, gpus):
        assert gpus == self.gpus
        allocs = [n for j in jobs for n in j.alloc]
        assert len(allocs) <= gpus
        assert np.bincount(allocs, minlength=gpus // NODES_GPUS).max(initial=0) <= NODES_GPUS
        assert all(len(j.alloc) in RUNGS for j in jobs)
        self.calls += 1
        return self.inner(now, jobs, gpus)


def test_no_policy_output_gets_more_gpus_than_the_cluster_has():
    net = make_net(0)
    with torch.no_grad():
        net[-1].bias.copy_(torch.arange(len(RUNGS), dtype=torch.float32) * 10)  # every job wants 64 GPUs
    jobs = load_jobs(Window(1, 0, 6))
    assert sum(Greedy(net)(0.0, jobs, 8)) > 8, "the network asks for more than there is"
    assert sum(grant(jobs, [64] * len(jobs), 8)) <= 8
    for chooser in (Greedy(net), Sampler(make_net(1), HyperSched(), torch.Generator().manual_seed(0)), HyperSched()):
        checked = _Checked(chooser, 8)
        ep = run_episode(load_jobs(Window(1, 0, 6)), checked, gpus=8)
        assert checked.calls > 10 and all(o.finish is not None for o in ep.outcomes)
        assert ep.jct_hours == pytest.approx(sum(o.jct for o in ep.outcomes) / 3600)


@pytest.fixture
def tiny_data(tmp_path):
    """The shipped Pollux data with each workload cut to its first 5 jobs (a fast, whole-workload eval)."""
    root = tmp_path / "pollux"
    (root / "workloads").mkdir(parents=True)
    (root / "traces").symlink_to(DEFAULT_ROOT / "traces")
    shutil.copytree(DEFAULT_ROOT / "results-jobload", root / "results-jobload")
    for w in range(1, 9):
        lines = (DEFAULT_ROOT / "workloads" / f"workload-{w}.csv").read_text().splitlines()
        (root / "workloads" / f"workload-{w}.csv").write_text("\n".join(lines[:6]) + "\n")
    return root


def test_cli_lists_both_policies_and_evaluates_them_on_an_unseen_workload(tiny_data, tmp_path, capsys):
    assert main(["sim", "pollux", "--policies", "nope"]) == 2
    assert "hypersched, mlfs" in capsys.readouterr().err
    assert main(["sim", "elasticflow", "--policies", "mlfs"]) == 2, "learned policies are for pollux"
    capsys.readouterr()
    png = tmp_path / "sim.png"
    argv = ["sim", "pollux", "--data", str(tiny_data), "--traces", "6", "--policies", "hypersched,mlfs,optimus"]
    assert main([*argv, "--episodes", "3", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in out["results"]}
    assert set(rows) == {"hypersched", "mlfs", "optimus"}
    assert all(r["jobs"] == r["finished"] == 5 for r in rows.values())
    assert rows["mlfs"]["unseen"] is True
    training = out["mlfs_training"]
    assert training["episodes"] == 3 and len(training["curve"]) == 3 and training["train_workloads"] == [1, 2, 3, 4]
    curve_png = tmp_path / "sim-mlfs-curve.png"
    assert curve_png.read_bytes()[:4] == b"\x89PNG" and png.exists()
