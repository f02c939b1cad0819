"""Training-health guard with the real trainer: 2 ranks over gloo, chaos-injected NaN and spikes.

One run takes a NaN (rank 1, step 6) and a loss spike (step 10): both roll back and skip, and its
final weights equal, bitwise, a fault-free run configured to skip the recorded sample ranges. Repeated
spikes exhaust the rollback budget (exit ≠ 0 with the report); a rank whose matmul is corrupted is
named by the burn-in. Rollbacks here come from memory snapshots (rollback_steps=2 fits the double
buffer), which keeps them independent of when the keeper persists; the storage path is tested on a
Checkpointer directly, where persistence is awaited.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from stalwart.health.log_rules import diagnose
from tests.e2e.hung import run_or_dump

pytestmark = pytest.mark.e2e
STEPS, BATCH, ROLLBACK, SKIP = 12, 8, 2, 2
COMMON = (
    "--data.seq_len=32",
    f"--train.steps={STEPS}",
    "--train.warmup_steps=2",
    f"--train.global_batch={BATCH}",
    "--train.micro_batch=2",
    "--checkpoint.enabled=true",
    "--checkpoint.persist_every_steps=2",
    "--checkpoint.keeper_idle_s=10",
    "--guard.enabled=true",
    "--guard.warmup_steps=4",
    "--guard.window=5",
    f"--guard.rollback_steps={ROLLBACK}",
    f"--guard.skip_batches={SKIP}",
    "--guard.max_rollbacks=2",
)


def train(out: Path, data: Path, shm: Path, *extra: str, chaos: str = "") -> subprocess.CompletedProcess:
    """`stalwart train --nproc 2`; incidents land in out/progress as under `stalwart run`."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        STALWART_CHAOS=chaos,
        STALWART_CHAOS_DIR=str(out / "chaos"),
        STALWART_PROGRESS_DIR=str(out / "progress"),
    )
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "train",
        "--nproc=2",
        "--config",
        "configs/debug.toml",
        f"--data.dir={data}",
        *COMMON,
        f"--train.out_dir={out}",
        f"--checkpoint.shm_dir={shm}",
        "--json",
        *extra,
    ]
    result = run_or_dump(cmd, timeout=300, env=env)
    (out / "train.log").write_text(result.stderr)  # kept for post-mortems
    return result


def summary(out: Path, result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def incidents(out: Path, rank: int) -> list[dict]:
    path = out / "progress" / f"rank{rank}.incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def faulted(stdlib_data, shm_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("faulted")
    return out, summary(out, train(out, stdlib_data, shm_root, chaos="nan:rank=1:step=6;spike:step=10"))


def test_nan_rolls_back_skips_and_matches_a_run_that_skips_the_same_samples(faulted, stdlib_data, shm_root, tmp_path):
    out, run = faulted
    nan = run["guard"]["rollbacks"][0]
    assert (nan["step"], nan["kind"]) == (6, "nan")
    assert nan["rolled_back_to"] <= 6 - ROLLBACK
    start, stop = nan["skipped_samples"]
    assert (start, stop) == (nan["rolled_back_to"] * BATCH, (nan["rolled_back_to"] + SKIP) * BATCH)
    assert run["steps"] == STEPS
    # The fault-free reference skips the recorded ranges from the start; same world size, bitwise.
    ref = summary(
        tmp_path, train(tmp_path, stdlib_data, shm_root, f"--data.skip_samples={run['guard']['skip_samples']}")
    )
    assert ref["guard"]["rollbacks"] == [], "no false alarm in the fault-free run"
    assert (ref["final_hash"], ref["optim_hash"]) == (run["final_hash"], run["optim_hash"])
    assert ref["samples_consumed"] == run["samples_consumed"]
    journal = incidents(out, 0)
    assert [(i["kind"], i["class"], i["step"]) for i in journal] == [
        ("rollback", "training", 6),
        ("rollback", "training", 10),
    ]
    assert journal[0]["detail"]["skipped_samples"] == [start, stop] and journal[0]["detail"]["verdict"] == "nan"
    assert incidents(out, 1) == [], "one journal entry per rollback, from rank 0"
    assert "matmul burn-in correct on all 2 ranks" in (out / "train.log").read_text()


def test_spike_is_caught_on_its_step_and_rolled_back_far_enough(faulted):
    out, run = faulted
    spike = run["guard"]["rollbacks"][1]
    assert (spike["step"], spike["kind"]) == (10, "loss_spike") and spike["value"] > spike["threshold"]
    assert spike["rolled_back_to"] <= 10 - ROLLBACK and "short" not in spike
    assert spike["skipped_samples"][1] - spike["skipped_samples"][0] == SKIP * BATCH
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    nan_back = run["guard"]["rollbacks"][0]["rolled_back_to"]
    assert [(r["step"], r["rollback"]["step"]) for r in records if "rollback" in r] == [
        (nan_back + 1, 6),
        (spike["rolled_back_to"] + 1, 10),
    ]  # on the first step after each rollback
    assert all(r["loss"] < 100 for r in records), "no poisoned step was ever applied or logged as a step"


def test_repeated_spikes_beyond_the_budget_stop_the_job_with_a_report(stdlib_data, shm_root, tmp_path):
    result = train(tmp_path, stdlib_data, shm_root, chaos="spike:step=9:once=0")
    assert result.returncode != 0
    assert "RollbackLimitExceeded: 3 rollbacks within 1000 steps (limit 2)" in result.stderr
    report = result.stderr[result.stderr.index("RollbackLimitExceeded:") :]
    rollbacks = [
        tuple(map(int, m))
        for m in re.findall(r"step 9: loss_spike → back to (\d+), skipped samples (\d+)\.\.(\d+)", report)[:2]
    ]
    assert len(rollbacks) == 2 and all(back <= 9 - ROLLBACK for back, _, _ in rollbacks), report
    assert rollbacks[1][2] > rollbacks[0][2], "the second rollback skips further than the first"
    assert "step 9: loss_spike (not rolled back)" in report
    d = diagnose(result.stderr)
    assert (d.kind, d.cls, d.retry(True)) == ("rollback_limit", "user", False), d
    journal = incidents(tmp_path, 0)
    assert [i["kind"] for i in journal] == ["rollback", "rollback", "rollback_limit"]
    assert "{}..{}".format(*rollbacks[1][1:]) in journal[-1]["detail"]["report"]


def test_a_rank_with_a_corrupted_matmul_is_named_by_the_burn_in(stdlib_data, shm_root, tmp_path):
    result = train(tmp_path, stdlib_data, shm_root, chaos="nan:rank=1:step=5;nan:rank=1:at=matmul")
    assert result.returncode != 0
    assert "SilentDataCorruption: non-finite loss at step 5; rank(s) [1] failed the matmul burn-in" in result.stderr
    d = diagnose(result.stderr)
    assert (d.kind, d.cls) == ("sdc", "hardware"), d
    (sdc,) = incidents(tmp_path, 1)
    assert (sdc["kind"], sdc["class"], sdc["step"], sdc["rank"]) == ("sdc", "hardware", 5, 1)
    assert sdc["detail"]["evict"] is True and sdc["detail"]["rank"] == 1
    assert incidents(tmp_path, 0) == [], "the healthy rank journals nothing"


def _persisting_run(shm_root: Path, tmp_path: Path, monkeypatch) -> tuple:
    """One process, steps 1–8 snapshotted, every 2nd persisted (keep_last=3). The keeper is slowed
    between each commit and its retention: wait(persist=True) must still return with storage as the
    policy leaves it (under load it once returned before, and a rollback then kept step 2 beside 4)."""
    from stalwart.checkpoint import Checkpointer
    from stalwart.data import GlobalSampler

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sampler = GlobalSampler(100, 4)
    state = {"model": model, "optim": opt, "sampler": sampler}
    monkeypatch.setenv("STALWART_CHAOS", "delay:seconds=0.5:at=retention")  # the keeper inherits it
    monkeypatch.setenv("STALWART_CHAOS_DIR", str(tmp_path / "chaos"))
    ckpt = Checkpointer(
        str(tmp_path / "ck"),
        persist_every_steps=2,
        keep_last=3,
        shm_root=str(shm_root),
        keeper_idle_s=5,
        keeper_log=tmp_path / "keeper.log",
    )

    def steps(first: int, last: int) -> dict[int, torch.Tensor]:
        weights = {}
        for step in range(first, last + 1):
            sampler.next_batch(0, 1)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step, state)
            ckpt.wait(persist=step % 2 == 0)
            weights[step] = model.weight.detach().clone()
        return weights

    return ckpt, state, steps


def test_checkpointer_rollback_uses_persisted_steps_and_forgets_the_abandoned_future(shm_root, tmp_path, monkeypatch):
    """The storage path: persisted steps 4, 6, 8 (memory holds 7, 8); a rollback to ≤ 5 loads step 4
    from storage and deletes 6 and 8, so no later restore resumes that future."""
    from stalwart.checkpoint.shm import complete_slots

    ckpt, state, steps = _persisting_run(shm_root, tmp_path, monkeypatch)
    model, sampler = state["model"], state["sampler"]
    weights = steps(1, 8)
    assert ckpt.storage.committed() == [8, 6, 4]
    info = ckpt.rollback(state, at_most=5, before=9)
    assert (info.source, info.step) == ("storage", 4)
    assert torch.equal(model.weight, weights[4]) and sampler.consumed == 16
    assert ckpt.storage.committed() == [4] and ckpt.storage.latest() == 4
    assert [s.step for s in complete_slots(ckpt.paths, 0)] == []  # 7 and 8 belonged to the abandoned future
    # Nothing at or before step 1 exists: the oldest checkpoint is taken, and the detail says so.
    info = ckpt.rollback(state, at_most=1, before=5)
    assert info.step == 4 and "oldest held" in info.detail
    with pytest.raises(LookupError, match="no checkpoint before step 3"):
        ckpt.rollback(state, at_most=0, before=3)
    ckpt.close(success=True)


def test_steps_redone_after_a_rollback_are_persisted_again(shm_root, tmp_path, monkeypatch):
    """After a rollback from 8 to 4, the redone steps 6 and 8 (the same numbers) are persisted and
    waited for: the keeper forgets that it had persisted 8 of the abandoned future."""
    ckpt, state, steps = _persisting_run(shm_root, tmp_path, monkeypatch)
    steps(1, 8)
    abandoned = ckpt.storage.manifest(8)["created"]
    assert ckpt.rollback(state, at_most=5, before=9).step == 4 and ckpt.storage.committed() == [4]
    steps(5, 8)
    assert ckpt.storage.committed() == [8, 6, 4], (tmp_path / "keeper.log").read_text()
    assert ckpt.storage.manifest(8)["created"] > abandoned, "step 8 of the redone trajectory"
    assert "rollback step 4" in (tmp_path / "keeper.log").read_text()
    # The final step: ensure_durable waits for the keeper's word (after its retention), even once
    # storage's ``latest`` already names the step (a trainer that comes late to the call).
    ckpt.save(9, state, persist=True)
    deadline = time.monotonic() + 30
    while ckpt.storage.latest() != 9 and time.monotonic() < deadline:
        time.sleep(0.005)
    ckpt.ensure_durable(9)
    assert ckpt.storage.committed() == [9, 8, 6]
    ckpt.close(success=True)


def test_starting_over_in_a_dir_with_committed_checkpoints_is_refused(shm_root, tmp_path, monkeypatch):
    """resume=false into a dir holding step 2: the new run's steps ≤ 2 could never be persisted and
    its end would read the old step 2 as durable. Refused, naming the steps, before anything is lost."""
    from stalwart.checkpoint import Checkpointer

    ckpt, _, steps = _persisting_run(shm_root, tmp_path, monkeypatch)
    steps(1, 2)
    ckpt.close(success=True)
    again = Checkpointer(str(tmp_path / "ck"), persist_every_steps=2, shm_root=str(shm_root), keeper_idle_s=5)
    with pytest.raises(ValueError, match=r"holds committed step\(s\) \[2\] of an earlier run") as refused:
        again.discard_snapshots()
    verdict = diagnose(f"stalwart: error: {refused.value}")  # as the CLI prints it: no restart fixes it
    assert (verdict.kind, verdict.cls, verdict.retry(True)) == ("checkpoint_dir_in_use", "user", False)
    assert again.storage.committed() == [2]
    again.close(success=True)
    fresh = Checkpointer(str(tmp_path / "empty"), persist_every_steps=2, shm_root=str(shm_root), keeper_idle_s=5)
    assert fresh.discard_snapshots() == 0
    fresh.close(success=True)
