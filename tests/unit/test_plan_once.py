"""The layout is planned exactly once per process: `stalwart train` with one process (the CLI's check
and the Trainer in the same process) calls the planner once, whether the degrees are explicit or auto."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COUNT_AND_TRAIN = """
import json, sys
import stalwart.train.resolve as r

calls = {"resolve": 0, "layout_from_config": 0, "auto_layout": 0}

def counted(name, fn):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper

for name in calls:  # before the trainer imports them by name
    setattr(r, name, counted(name, getattr(r, name)))
from stalwart.commands.train import train

summary = train(None, json.loads(sys.argv[1]), 1)
print("CALLS " + json.dumps(dict(calls, steps=summary["steps"], layout=summary["layout"]["describe"])))
"""


@pytest.mark.parametrize("layout", ["manual", "auto"])
def test_one_process_plans_once(stdlib_data: Path, tmp_path: Path, layout: str) -> None:
    overrides = {
        "data.dir": str(stdlib_data),
        "data.prepare_default": "false",
        "data.seq_len": "32",
        "train.steps": "1",
        "train.warmup_steps": "0",
        "train.global_batch": "4",
        "train.micro_batch": "2",
        "train.out_dir": str(tmp_path),
        "train.log_every": "1",
        "parallel.layout": layout,
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    }
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_AND_TRAIN, json.dumps(overrides)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("CALLS "))[6:])
    assert calls["steps"] == 1 and calls["resolve"] == 1, calls
    planner = "auto_layout" if layout == "auto" else "layout_from_config"
    assert calls[planner] == 1 and calls["auto_layout"] + calls["layout_from_config"] == 1, calls
