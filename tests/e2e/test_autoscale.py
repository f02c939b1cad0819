"""The live autoscaler in a real elastic job (`--nnodes 2:3`, master-served rendezvous, `--autoscale on`).

Three agents run a small data-parallel regression with a fixed global batch of 12 samples (each rank
takes its share, gradients are summed and divided by 12: the update does not depend on the world
size) and fixed work per step. node2 is throttled (chaos ``slow:at=node:factor=6``): the master's
throughput model predicts that two nodes train faster than three, node2 leaves (exit 3), node0 and
node1 regroup from the newest state and finish. Outcomes: one autoscale decision (no flapping), the
recommendation settles at 2, every step done, and the loss curve within 1e-4 of the same arithmetic
in one process.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import torch

from stalwart.launch.client import MasterClient
from stalwart.launch.journal import Journal

from .test_elastic import lose_node, start_master, start_node
from .test_master import TOKEN
from .test_spares import EVICTED, joined, wait_for

pytestmark = pytest.mark.e2e
STEPS, BATCH, LR = 120, 12, 0.05

REGRESSION = """
import argparse, json, os, time
from pathlib import Path
import torch, torch.distributed as dist
from stalwart import report

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--steps", type=int, required=True)
args = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
X = torch.randn(BATCH, 16, generator=g, dtype=torch.float64)
Y = X @ torch.randn(16, 1, generator=g, dtype=torch.float64)
state_file = args.out / "state.json"  # rank 0 saves every step: a regrouped job resumes exactly
state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "w": [0.0] * 16}
w = torch.tensor(state["w"], dtype=torch.float64).reshape(16, 1)
mine = torch.arange(BATCH)[rank::world]  # this rank's share of the fixed global batch
work = torch.randn(128, 128, generator=torch.Generator().manual_seed(1)) / 12
while state["step"] < args.steps:
    t0 = time.perf_counter()
    x = torch.ones(128, 128)
    for _ in range(300):  # fixed work: a throttled node takes longer for it
        x = torch.tanh(x @ work)
    err = X[mine] @ w - Y[mine]
    grad_and_loss = torch.cat([(2 * X[mine].T @ err).flatten(), (err ** 2).sum().reshape(1)])
    compute_s = time.perf_counter() - t0
    dist.all_reduce(grad_and_loss)
    w = w - LR * grad_and_loss[:16].reshape(16, 1) / BATCH
    loss = grad_and_loss[16].item() / BATCH
    state = {"step": state["step"] + 1, "w": w.flatten().tolist()}
    if rank == 0:
        with open(args.out / "losses.jsonl", "a") as f:
            f.write(json.dumps({"step": state["step"], "loss": loss, "world": world}) + "\\n")
        (args.out / "state.tmp").write_text(json.dumps(state))
        os.replace(args.out / "state.tmp", state_file)
    dist.barrier()
    report(state["step"], loss=loss, compute_s=compute_s)
    time.sleep(0.02)
""".replace("BATCH", str(BATCH)).replace("LR", repr(LR))


def reference_losses() -> dict[int, float]:
    """The same arithmetic in one process, the whole batch at once."""
    g = torch.Generator().manual_seed(0)
    x, true_w = (
        torch.randn(BATCH, 16, generator=g, dtype=torch.float64),
        torch.randn(16, 1, generator=g, dtype=torch.float64),
    )
    y, w, out = x @ true_w, torch.zeros(16, 1, dtype=torch.float64), {}
    for step in range(1, STEPS + 1):
        err = x @ w - y
        out[step] = (err**2).sum().item() / BATCH
        w = w - LR * (2 * x.T @ err) / BATCH
    return out


def test_a_throttled_node_makes_the_autoscaler_shrink_the_job_without_changing_the_loss_curve(tmp_path):
    job = f"autoscale-{uuid.uuid4().hex[:8]}"
    (tmp_path / "job").mkdir()
    (tmp_path / "regression.py").write_text(REGRESSION)
    script = (str(tmp_path / "regression.py"), "--out", str(tmp_path / "job"), "--steps", str(STEPS))
    master, address = start_master(
        tmp_path, "--autoscale", "on", "--autoscale-cooldown", "0", "--autoscale-restart-cost", "1"
    )
    client = MasterClient(address, TOKEN)
    nodes: dict[int, subprocess.Popen] = {}
    try:
        for n, chaos in ((0, ""), (1, ""), (2, "slow:at=node:factor=6")):
            flags = ("--nnodes", "2:3", "--straggler-window", "1", "--summary-json", str(tmp_path / f"summary{n}.json"))
            chaos_flags = ("--chaos", chaos) if chaos else ()
            nodes[n] = start_node(tmp_path, tmp_path, address, job, n, run=(*flags, *chaos_flags), script=script)
        wait_for("three nodes joining", joined(client, "node0", "node1", "node2"), nodes, tmp_path)
        assert nodes[2].wait(timeout=120) == EVICTED, (tmp_path / "node2.log").read_text()[-3000:]
        for n in (0, 1):
            assert nodes[n].wait(timeout=120) == 0, (tmp_path / f"node{n}.log").read_text()[-4000:]
        scale = client.status()["autoscale"]
    finally:
        for n, p in nodes.items():
            if p.poll() is None:
                lose_node(p, job, n)
        master.terminate()
        master.wait(10)
    journal = Journal(tmp_path / "journal.sqlite")
    acted = [d for d in journal.decisions() if d["action"] == "evict"]
    assert len(acted) == 1 and acted[0]["details"]["cause"] == "autoscale", acted
    assert acted[0]["details"]["node_id"] == "node2" and acted[0]["details"]["best"] == 2, acted
    assert (scale["current"], scale["best"]) == (2, 2), f"the recommendation settles at 2 nodes: {scale}"
    rows = [json.loads(line) for line in (tmp_path / "job" / "losses.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows}  # a redone step keeps the value that went on
    assert sorted(losses) == list(range(1, STEPS + 1)), "every step trained"
    assert {r["world"] for r in rows} == {2, 3}, "trained at 3 nodes, then at 2"
    expected = reference_losses()
    worst = max(abs(losses[s] - expected[s]) for s in expected)
    assert worst < 1e-4, f"loss curve parted from the fixed-batch reference by {worst}"
