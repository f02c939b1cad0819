"""The trainer for real: separate processes, gloo groups, the installed CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
STEPS = 20
WARMUP = ("--train.warmup_steps=2",)  # short runs: the 1-process reference uses the same


def stalwart(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True, timeout=timeout)


def train(out: Path, data: Path, *extra: str, nproc: int = 1, steps: int = STEPS) -> dict:
    result = stalwart(
        "train",
        "--config",
        "configs/debug.toml",
        "--nproc",
        str(nproc),
        "--json",
        f"--data.dir={data}",
        "--data.seq_len=64",
        f"--train.steps={steps}",
        *WARMUP,
        f"--train.out_dir={out}",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    summary["losses"] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), stdlib_data)


@pytest.fixture(scope="module")
def ddp_run(stdlib_data, tmp_path_factory):
    return train(tmp_path_factory.mktemp("ddp"), stdlib_data, nproc=2)


def assert_same_curve(run: dict, reference: dict, rtol: float = 1e-4) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == run["steps"]
    for step, (a, b) in enumerate(zip(run["losses"], reference["losses"]), 1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs {b}"
    assert run["samples_consumed"] == reference["samples_consumed"]


def test_ddp_two_ranks_matches_one_process(ddp_run, reference):
    assert ddp_run["world_size"] == 2 and ddp_run["grad_accum"] == reference["grad_accum"] // 2
    assert_same_curve(ddp_run, reference)
    assert reference["losses"][-1] < reference["losses"][0] - 1.0, "the model should learn"


@pytest.mark.parametrize("reshard", ["true", "false"], ids=["zero3", "zero2"])
def test_fsdp2_two_ranks_matches_one_process(stdlib_data, tmp_path, reference, reshard):
    run = train(
        tmp_path, stdlib_data, "--parallel.dp_mode=fsdp", f"--parallel.reshard_after_forward={reshard}", nproc=2
    )
    assert run["dp_mode"] == "fsdp"
    assert_same_curve(run, reference)


def test_deterministic_runs_are_bitwise_identical(stdlib_data, tmp_path, ddp_run):
    again = train(tmp_path / "again", stdlib_data, nproc=2)
    assert again["final_hash"] == ddp_run["final_hash"]
    assert again["losses"] == ddp_run["losses"]
    other_seed = train(tmp_path / "seed", stdlib_data, "--train.seed=1", nproc=2, steps=2)
    assert other_seed["final_hash"] != ddp_run["final_hash"]


def test_under_torchrun_uses_launcher_environment(stdlib_data, tmp_path, reference):
    out = tmp_path / "torchrun"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "stalwart",
            "train",
            "--config",
            "configs/debug.toml",
            f"--data.dir={stdlib_data}",
            "--data.seq_len=64",
            f"--train.steps={STEPS}",
            *WARMUP,
            f"--train.out_dir={out}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(reference["losses"], rel=1e-4)


def test_bad_config_fails_before_spawning(tmp_path):
    result = stalwart("train", "--nproc", "3", f"--train.out_dir={tmp_path}", timeout=60)
    assert result.returncode == 2
    assert "not divisible by data-parallel ranks (3)" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
    result = stalwart("train", "--train.stepz", "3", timeout=60)
    assert result.returncode == 2 and "did you mean 'train.steps'" in result.stderr


def test_every_command_explains_itself():
    import argparse

    from stalwart.cli import build_parser

    top = stalwart("--help", timeout=60)
    assert top.returncode == 0
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    commands = list(sub.choices)
    assert {"train", "data", "demo", "run", "master"} <= set(commands)
    for command in commands:
        assert command in top.stdout
        result = stalwart(command, "--help", timeout=60)
        assert result.returncode == 0 and len(result.stdout) > 200, command
    assert "--section.key" in stalwart("train", "--help").stdout
    assert "--vocab-size" in stalwart("data", "prepare", "--help").stdout
    assert (
        "--nproc-per-node" in stalwart("run", "--help").stdout and "--hang-timeout" in stalwart("run", "--help").stdout
    )
