"""Gloo ranks as real processes, forked warm: the tests that run a script as ``world`` ranks start
each rank through the node zygote production uses (``stalwart.launch.zygote``), so a rank begins with
torch and the checkpoint stack imported instead of spending seconds on a cold import (4 executions × 2
ranks in test_ckpt_epoch alone were ~25 s of cold starts each under the suite's load). Each rank is
still its own process, with its own environment, arguments and exit code."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

from stalwart.launch.zygote import DEFAULT_PRELOAD, Zygote
from stalwart.utils.ports import free_port

_zygote: Zygote | None = None
# The test process's at import: scripts import the tests package. The same string goes to the zygote
# and to every rank: sys.path grows while the suite runs, and a rank whose PYTHONPATH is not the
# zygote's starts cold (half the ranks of a unit run did, ~10 s each under load, unseen)
SYS_PATH = os.pathsep.join(sys.path)


def _warm() -> Zygote:
    """The test process's zygote, started on first use and stopped when the process exits."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote([*DEFAULT_PRELOAD, "stalwart.checkpoint"])
        atexit.register(_zygote.stop)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SYS_PATH  # the ranks' (a worker with another PYTHONPATH starts cold)
    try:
        _zygote.ensure()
    finally:
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
    return _zygote


def run_ranks(script: Path, world: int, args: list[str]) -> dict[int, dict]:
    """``script`` as ``world`` gloo processes (``args`` after it); rank → the JSON row each prints last."""
    port = free_port()
    zygote = _warm()
    entry, entry_args = zygote.entrypoint([str(script), *args])
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", **zygote.env())
        env.update(MASTER_PORT=str(port), PYTHONPATH=SYS_PATH, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen([entry, *entry_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    rows = {}
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        assert "starting cold" not in err, f"the zygote did not fork this rank: {err[-1000:]}"
        row = json.loads(out.strip().splitlines()[-1])
        rows[row["rank"]] = row
    return rows
