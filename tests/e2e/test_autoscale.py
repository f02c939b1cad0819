"""The live autoscaler in a real elastic job (`--nnodes 2:3`, master-served rendezvous, `--autoscale on`).

Three agents run a small data-parallel regression with a fixed global batch of 12 samples (each rank
takes its share, gradients are summed and divided by 12: the update does not depend on the world
size). Each rank's "device time" per step is a wait proportional to its share of the batch and to its
node's slowness (``nodeN.factor``), as a GPU-bound step looks from the host: the autoscaler's model
(compute grows as the share does) holds, and what it measures does not depend on how three nodes'
processes share this host's two cores with the suite (CPU work did: a node starved by its neighbours
measured slower and was parked right after its rejoin, CI47). CPU throttling of a node (chaos
``slow:at=node``) is covered by test_spares. node2 is 6× slow: the master's throughput model predicts
that two nodes train faster than three and parks node2: it steps out of the rendezvous and waits as a
spare, node0 and node1 regroup from the newest state and finish; judged by its last window node2 is
never worth taking back, and it exits 0 when the job's rendezvous closes. Outcomes: one autoscale
decision (no flapping), the recommendation settles at 2, every step done, and the loss curve within
1e-4 of the same arithmetic in one process.
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
from .test_spares import SCRIPT_HEADER, joined, wait_for

pytestmark = pytest.mark.e2e
MAX_STEPS, BATCH, LR = 2000, 12, 0.05  # a ceiling: the test ends the job by its stop_at file

REGRESSION = (
    SCRIPT_HEADER
    + """
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
X = torch.randn(BATCH, 16, generator=g, dtype=torch.float64)
Y = X @ torch.randn(16, 1, generator=g, dtype=torch.float64)
state_file = args.out / "state.json"  # rank 0 saves every step: a regrouped job resumes exactly
state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "w": [0.0] * 16}
w = torch.tensor(state["w"], dtype=torch.float64).reshape(16, 1)
mine = torch.arange(BATCH)[rank::world]  # this rank's share of the fixed global batch
slower = args.out / (os.environ["STALWART_NODE_ID"] + ".factor")  # the test slows a node down live
stop_at = args.out / "stop_at"  # the test ends the job a set number of steps after what it waits for


def last_step() -> int:
    # Every rank reads it before each step; the test writes it far enough ahead that all ranks see it
    return min(args.steps, int(stop_at.read_text())) if stop_at.exists() else args.steps


while state["step"] < last_step():
    t0 = time.perf_counter()
    # Device time: 10 ms per sample of this rank's share, times the node's slowness (GPU-bound: the host waits)
    time.sleep(0.01 * len(mine) * (float(slower.read_text()) if slower.exists() else 1.0))
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
)


def reference_losses(steps: int) -> dict[int, float]:
    """The same arithmetic in one process, the whole batch at once."""
    g = torch.Generator().manual_seed(0)
    x, true_w = (
        torch.randn(BATCH, 16, generator=g, dtype=torch.float64),
        torch.randn(16, 1, generator=g, dtype=torch.float64),
    )
    y, w, out = x @ true_w, torch.zeros(16, 1, dtype=torch.float64), {}
    for step in range(1, steps + 1):
        err = x @ w - y
        out[step] = (err**2).sum().item() / BATCH
        w = w - LR * (2 * x.T @ err) / BATCH
    return out


def run_job(tmp_path, settle_at: int, when_parked=None, after: int = 30) -> tuple[dict, list[dict], list[dict]]:
    """The three-node job under `--autoscale on`: ``when_parked()`` runs once node2 is parked; the job ends
    ``after`` steps past the moment the master's view says it runs at ``settle_at`` nodes (after the park,
    and the unpark where one is expected) — however long the opening stretch took under load (a job that
    began at 2 nodes, an agent late to the first round, once ran 70 of 120 fixed steps before growing).
    Returns the master's last autoscale view, its park/unpark/evict decisions and rank 0's loss rows."""
    job = f"autoscale-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "job"
    out.mkdir()
    (tmp_path / "regression.py").write_text(REGRESSION)
    script = (str(tmp_path / "regression.py"), "--out", str(out), "--steps", str(MAX_STEPS))
    master, address = start_master(
        tmp_path, "--autoscale", "on", "--autoscale-cooldown", "0", "--autoscale-restart-cost", "1"
    )
    client = MasterClient(address, TOKEN)
    nodes: dict[int, subprocess.Popen] = {}
    decided = lambda action: lambda: any(d["action"] == action for d in client.status()["decisions"])
    try:
        (out / "node2.factor").write_text("6")
        for n in (0, 1, 2):
            flags = ("--nnodes", "2:3", "--straggler-window", "1", "--summary-json", str(tmp_path / f"summary{n}.json"))
            nodes[n] = start_node(tmp_path, tmp_path, address, job, n, run=flags, script=script)
        wait_for("three nodes joining", joined(client, "node0", "node1", "node2"), nodes, tmp_path)
        wait_for("node2 parked", decided("park"), nodes, tmp_path, timeout=150)
        if when_parked is not None:
            when_parked()
            wait_for("node2 unparked", decided("unpark"), nodes, tmp_path, timeout=150)
        settled = lambda: (client.status().get("autoscale") or {}).get("current") == settle_at
        wait_for(f"the job at {settle_at} nodes", settled, nodes, tmp_path, timeout=150)
        (out / "stop.tmp").write_text(str(max(r["step"] for r in _trained(out)) + after))
        (out / "stop.tmp").replace(out / "stop_at")
        for n in (0, 1, 2):
            assert nodes[n].wait(timeout=180) == 0, (tmp_path / f"node{n}.log").read_text()[-4000:]
        scale = client.status()["autoscale"]
    finally:
        for n, p in nodes.items():
            if p.poll() is None:
                lose_node(p, job, n)
        master.terminate()
        master.wait(10)
    acted = [d for d in Journal(tmp_path / "journal.sqlite").decisions() if d["action"] in ("evict", "park", "unpark")]
    rows = _trained(out)
    losses = {r["step"]: r["loss"] for r in rows}  # a redone step keeps the value that went on
    steps = int((out / "stop_at").read_text())
    assert sorted(losses) == list(range(1, steps + 1)), "every step trained, and the job ended where the test said"
    expected = reference_losses(steps)
    worst = max(abs(losses[s] - expected[s]) for s in expected)
    assert worst < 1e-4, f"loss curve parted from the fixed-batch reference by {worst}"
    return scale, acted, rows


def _trained(out) -> list[dict]:
    """Rank 0's loss rows, one per step done (a step redone after a regroup appears again); a line still
    being appended is left out."""
    text = (out / "losses.jsonl").read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def worlds(rows: list[dict]) -> list[int]:
    """The world sizes rank 0 trained at, in order, each once per stretch. A job that began at 2 nodes and
    grew to 3 began as the three agents did: one reached the rendezvous after the round's last call
    (2 s; CI14 under load: [2, 3, 2]); the master made no decision for that, and it is not counted."""
    stretches = [w for i, w in enumerate(r["world"] for r in rows) if i == 0 or rows[i - 1]["world"] != w]
    return stretches[1:] if stretches[:2] == [2, 3] else stretches


def test_a_throttled_node_is_parked_and_the_job_trains_on_without_it(tmp_path):
    scale, acted, rows = run_job(tmp_path, settle_at=2)
    assert [(d["action"], d["details"]["node_id"], d["details"]["best"]) for d in acted] == [("park", "node2", 2)]
    assert acted[0]["details"]["cause"] == "autoscale"
    assert (scale["current"], scale["best"]) == (2, 2), f"the recommendation settles at 2 nodes: {scale}"
    assert worlds(rows) == [3, 2], "trained at 3 nodes, then at 2"
    log2 = (tmp_path / "node2.log").read_text()
    assert "node node2 parked as a spare: autoscale: 2 nodes train" in log2 and "unparked" not in log2


def test_a_parked_node_rejoins_when_the_others_slow_down(tmp_path):
    """node0 and node1 turn 8× slower once node2 is parked: three nodes (node2 judged by its last,
    6×-slow window) now train faster than two, so node2 is unparked and the job grows back."""

    def slow_the_others() -> None:
        for n in (0, 1):
            (tmp_path / "job" / f"node{n}.factor").write_text("8")

    # 40 steps at 3 nodes after the rejoin (~0.35 s each, many 1 s windows): no second park (no flapping)
    scale, acted, rows = run_job(tmp_path, settle_at=3, when_parked=slow_the_others, after=40)
    assert [(d["action"], d["details"]["node_id"]) for d in acted] == [("park", "node2"), ("unpark", "node2")]
    # The unpark's own view said 3 nodes are best, and the job stayed at 3 (no second park: no flapping).
    # The final view is not asserted: re-measured on a 2-core host, three nodes' processes share two
    # cores with the suite's other worker and may measure slower than two did (seen once in CI).
    assert acted[1]["details"]["best"] == 3 and scale["current"] == 3, scale
    assert worlds(rows) == [3, 2, 3], "trained at 3 nodes, at 2, and at 3 again"
    assert "node node2 unparked: rejoining the job" in (tmp_path / "node2.log").read_text()
