"""Hybrid layouts through the real CLI: `stalwart train --nproc N` and `stalwart run` (gloo, real
processes, the debug models). The library's numerics are covered in-process by test_parallel.py;
this file proves the trainer wiring: config → layout, data per data-parallel rank, the logged
loss, hashes over every pipeline stage, flash checkpoints across layouts and SIGKILL recovery.

Every run uses a constant learning rate (no warmup, min_lr = lr), so runs of different lengths
follow one trajectory and a restored run can be compared with the 1-process reference step by step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
STEPS, MORE = 10, 2  # layout runs; the restored run continues for MORE steps
RTOL = 1e-4
COMMON = ("--config", "configs/debug.toml", "--data.seq_len=32", "--train.global_batch=8", "--train.micro_batch=2",
          "--train.warmup_steps=0", "--train.lr=3e-3", "--train.min_lr=3e-3", "--train.log_every=100")


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(out: Path, data: Path, *extra: str, nproc: int = 2, steps: int = STEPS) -> dict:
    """`stalwart train --nproc N`; returns summary.json plus the logged losses and stderr."""
    cmd = [sys.executable, "-m", "stalwart", "train", f"--nproc={nproc}", *COMMON, f"--data.dir={data}",
           f"--train.steps={steps}", f"--train.out_dir={out}", "--json", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    return dict(summary, losses=losses(out), stderr=result.stderr)


def run_job(tmp: Path, data: Path, *extra: str, nproc: int, chaos: str | None = None) -> tuple[dict, dict]:
    """`stalwart run` (job master + agent) over `stalwart train` with flash checkpoints."""
    cmd = [sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", "--hang-timeout", "60", "--run-dir", str(tmp / "run"),
           "--summary-json", str(tmp / "run.json"), *(["--chaos", chaos] if chaos else []),
           "-m", "stalwart", "train", *COMMON, f"--data.dir={data}", f"--train.steps={STEPS}",
           f"--train.out_dir={tmp / 'out'}", "--checkpoint.enabled=true", f"--checkpoint.dir={tmp / 'ckpt'}",
           "--checkpoint.persist_every_steps=5", "--checkpoint.keeper_idle_s=60", *extra]
    env = dict(os.environ, STALWART_CHAOS_DIR=str(tmp / "chaos"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp / "out" / "summary.json").read_text())
    return json.loads((tmp / "run.json").read_text()), dict(summary, losses=losses(tmp / "out"))


def assert_matches(run: dict, ref: list[float], expect: dict[str, int]) -> None:
    degrees = {k: v for k, v in run["layout"]["degrees"].items() if v > 1}
    assert degrees == expect, run["layout"]
    assert len(run["losses"]) == len(ref)
    for step, (a, b) in enumerate(zip(run["losses"], ref), 1):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: loss {a} vs 1-process {b}"


def checkpoint_hash(ckpt: Path, step: int, model: str = "debug") -> str:
    """Hash of a persisted checkpoint's weights loaded into a plain, unsplit model."""
    import torch.distributed.checkpoint as dcp

    from stalwart.models import build_model, model_args
    from stalwart.utils import state_dict_hash

    net = build_model(model, model_args(model, vocab_size=257, max_seq_len=32))  # byte corpus: 257 ids
    state = {"model": net.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt / f"step-{step:08d}"))
    net.load_state_dict(state["model"])
    return state_dict_hash(net.state_dict())


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory) -> list[float]:
    run = train(tmp_path_factory.mktemp("ref"), stdlib_data, nproc=1, steps=STEPS + MORE)
    assert run["losses"][STEPS - 1] < run["losses"][0] - 1.0, "the reference should learn"
    return run["losses"]


# -- losses of each layout vs one process ----------------------------------------------------------
LAYOUTS = {
    # name: (config overrides, expected degrees); TP2 with replicated logits and selective recompute
    "tp2": (["--parallel.tp=2", "--parallel.loss_parallel=false", "--parallel.recompute=selective"], {"tp": 2}),
    "pp2_interleaved": (["--parallel.pp=2", "--parallel.schedule=interleaved_1f1b", "--parallel.virtual_stages=2",
                         "--parallel.recompute=full"], {"pp": 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(name, stdlib_data, tmp_path, reference):
    extra, expect = LAYOUTS[name]
    assert_matches(train(tmp_path, stdlib_data, *extra), reference[:STEPS], expect)


def test_expert_parallel_moe_matches_one_process(stdlib_data, tmp_path):
    ref = train(tmp_path / "ref", stdlib_data, "--model.name=debug-moe", nproc=1)
    run = train(tmp_path / "ep", stdlib_data, "--model.name=debug-moe", "--parallel.dp_mode=fsdp", "--parallel.ep=2")
    assert_matches(run, ref["losses"], {"dp_shard": 2, "ep": 2})
    records = [json.loads(line) for line in (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["aux_loss"] > 0 for r in records), "the load-balancing loss is logged"


def test_auto_layout_fits_runs_and_explains(stdlib_data, tmp_path, reference):
    run = train(tmp_path, stdlib_data, "--parallel.layout=auto")
    d = run["layout"]["degrees"]
    assert d["pp"] * d["dp_replicate"] * d["dp_shard"] * d["tp"] == 2
    why = run["layout"]["auto"]
    assert why.startswith("parallel = 'auto' chose") and "why:" in why
    assert why.splitlines()[0] in run["stderr"], "the choice is printed"
    assert_matches(run, reference[:STEPS], {k: v for k, v in d.items() if v > 1})


# -- SIGKILL under `stalwart run`: bitwise recovery; restore under another layout --------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("extra, nproc, expect, then_ddp", [
    (["--parallel.pp=2"], 2, {"pp": 2}, False),
    (["--parallel.dp_mode=fsdp", "--parallel.tp=2"], 4, {"dp_shard": 2, "tp": 2}, True),
], ids=["pp2", "fsdp2_tp2"])
def test_sigkill_recovers_bitwise(extra, nproc, expect, then_ddp, stdlib_data, tmp_path, reference):
    run, clean = run_job(tmp_path / "clean", stdlib_data, *extra, nproc=nproc)
    assert run["incidents"] == []
    assert_matches(clean, reference[:STEPS], expect)
    # The hashes cover the whole model (every pipeline stage, every shard): equal to the hash of the
    # persisted final checkpoint loaded into a plain model.
    assert clean["final_hash"] == checkpoint_hash(tmp_path / "clean" / "ckpt", STEPS)

    run, killed = run_job(tmp_path / "killed", stdlib_data, *extra, nproc=nproc, chaos="kill:rank=1:step=6")
    [incident] = run["incidents"]
    assert incident["kind"] == "sigkill" and run["restarts_used"] == 1
    ck = killed["checkpoint"]
    assert (ck["restored_from"], ck["restore_step"]) == ("memory", 6), ck
    assert killed["final_hash"] == clean["final_hash"] and killed["optim_hash"] == clean["optim_hash"]

    if then_ddp:
        # Saved under FSDP2 × TP2 (4 ranks), restored under plain DDP on 2 ranks (model and AdamW state
        # resharded from 2-D DTensor shards): training continues on the 1-process curve.
        shutil.copytree(tmp_path / "clean" / "ckpt", tmp_path / "ddp" / "ckpt")
        more = train(tmp_path / "ddp", stdlib_data, "--checkpoint.enabled=true",
                     f"--checkpoint.dir={tmp_path / 'ddp' / 'ckpt'}", "--checkpoint.keeper_idle_s=10",
                     steps=STEPS + MORE)
        ck = more["checkpoint"]
        assert (ck["restored_from"], ck["restore_step"]) == ("storage", STEPS), ck
        assert more["steps"] == STEPS + MORE
        assert_matches(more, reference[STEPS:], {"dp_replicate": 2})
