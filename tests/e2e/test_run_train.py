"""`stalwart run` + `stalwart train` with flash checkpoints: every fault kind ends in the same weights
as a fault-free run (bitwise: model and optimizer state), and the incident is journaled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.launch.journal import Journal

pytestmark = pytest.mark.e2e
STEPS = 12


def run_job(tmp_path: Path, data: Path, chaos: str | None = None) -> tuple[dict, dict]:
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--hang-timeout",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        "--summary-json",
        str(tmp_path / "run.json"),
        *(["--chaos", chaos] if chaos else []),
        "-m",
        "stalwart",
        "train",
        "--config",
        "configs/debug.toml",
        f"--data.dir={data}",
        "--data.seq_len=64",
        f"--train.steps={STEPS}",
        "--train.warmup_steps=2",
        f"--train.out_dir={tmp_path / 'out'}",
        "--checkpoint.enabled=true",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        "--checkpoint.persist_every_steps=4",
    ]
    env = {**__import__("os").environ, "STALWART_CHAOS_DIR": str(tmp_path / "chaos")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (tmp_path / "run.err").write_text(proc.stderr)
    return json.loads((tmp_path / "run.json").read_text()), json.loads((tmp_path / "out" / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    run, summary = run_job(tmp_path_factory.mktemp("ref"), stdlib_data)
    assert run["incidents"] == []
    assert run["storage"]["ok"] and run["storage"]["last_committed"] == STEPS, "the report has the final commit"
    return summary


@pytest.mark.parametrize(
    "action, kind", [("kill", "sigkill"), ("segv", "sigsegv"), ("raise", "exit"), ("stop", "hang"), ("hang", "hang")]
)
def test_fault_recovers_to_bitwise_identical_weights(stdlib_data, tmp_path, reference, action, kind):
    run, summary = run_job(tmp_path, stdlib_data, f"{action}:rank=1:step=6")
    assert summary["final_hash"] == reference["final_hash"]
    assert summary["optim_hash"] == reference["optim_hash"]
    assert summary["samples_consumed"] == reference["samples_consumed"]
    [incident] = run["incidents"]
    assert incident["kind"] == kind and run["restarts_used"] == 1
    assert incident["fault"] <= incident["detected"] <= incident["first_step"]
    # Restarted at the same placement: the workers reload the step-6 memory snapshot.
    assert summary["checkpoint"]["restored_from"] == "memory" and summary["checkpoint"]["restore_step"] == 6
    logged = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert set(logged) == set(range(1, STEPS + 1)), "the resumed run appends to the metrics log"
    [row] = Journal(tmp_path / "run" / "journal.sqlite").incidents()
    assert row["details"]["warm_start"] is True, "restarted ranks were forked by the node's zygote"
    # Step 6 is saved on failure: by the node's keeper when it is up (it outlives the workers and saves
    # in parallel with the restart, so the agent leaves it to it), else by the agent itself; or the agent,
    # not seeing the keeper's lock at that moment, found the keeper's save already committed (CI21).
    saved = row["details"]["save_on_failure"]["detail"]
    if saved in ("the node's keeper saves on failure", "step 6 is already covered by committed step 6"):
        assert "save-on-failure step 6" in (tmp_path / "out" / "keeper.log").read_text()
    else:
        assert saved.startswith("persisted step 6 "), saved


def test_a_keeper_killed_mid_persist_is_replaced_and_training_never_notices(stdlib_data, tmp_path, reference):
    """Under `stalwart run` the agent's keeper serves the node; killed (as by the OOM killer) while it
    writes its first step, the agent starts another, which persists the rest. Before, nobody replaced
    it: every later persist failed after 30 s ("no keeper serves"), restart after restart."""
    run, summary = run_job(tmp_path, stdlib_data, "kill:at=persist")  # its first: a late keeper coalesces
    assert (summary["final_hash"], summary["optim_hash"]) == (reference["final_hash"], reference["optim_hash"])
    assert run["incidents"] == [] and run["restarts_used"] == 0, "the workers never noticed"
    assert "exited with -9 while the job ran; started keeper pid" in (tmp_path / "run.err").read_text()
    assert run["storage"]["ok"] and run["storage"]["last_committed"] == STEPS
    assert (tmp_path / "ckpt" / "latest").read_text() == f"step-{STEPS:08d}"
