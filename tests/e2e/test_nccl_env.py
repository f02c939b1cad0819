"""`stalwart run` gives its workers the NCCL defaults (docs/techniques.md): a real agent and worker,
the worker's own environment read back (the off switch and the parser: tests/unit/test_nccl_env.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.launch.nccl_env import NCCL_DEFAULTS

pytestmark = pytest.mark.e2e
DUMP = "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n"


def worker_env(tmp_path: Path, *run_args: str, env: dict[str, str]) -> dict[str, str]:
    script, out = tmp_path / "dump_env.py", tmp_path / "env.json"
    script.write_text(DUMP)
    base = {k: v for k, v in os.environ.items() if k not in NCCL_DEFAULTS}
    cmd = [sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["--run-dir", str(tmp_path / "run"), *run_args, str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**base, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_defaults_set_and_user_value_wins(tmp_path):
    got = worker_env(tmp_path, env={"NCCL_IB_TIMEOUT": "18"})
    assert got["NCCL_IB_TIMEOUT"] == "18", "the user's own value wins"
    for name, (value, _) in NCCL_DEFAULTS.items():
        if name != "NCCL_IB_TIMEOUT":
            assert got.get(name) == value, name
