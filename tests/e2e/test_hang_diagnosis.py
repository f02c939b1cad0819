"""Hang diagnosis for real: four ranks under `stalwart run`, one stops entering collectives; the
journaled hang incident names the group, the collective, the rank behind with its coordinates and
the ranks waiting on it, from the ranks' Flight Recorder dumps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.launch.journal import Journal

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent / "scripts" / "mesh_collectives.py"
STUCK, AT = 3, 4  # rank 3 = pp1 dp1: its dp group is [2, 3], its pp group [1, 3]


def hang_diagnosis(tmp_path: Path, *script_args: str) -> dict:
    """The collectives diagnosis of the one hang incident of a 4-rank mesh_collectives.py job."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "0"]
    cmd += ["--hang-timeout", "3", "--run-dir", str(run), str(SCRIPT), "--at-step", str(AT), *script_args]
    env = dict(os.environ, STALWART_CHAOS_DIR=str(tmp_path / "chaos"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode != 0, "the hung job fails (no restarts allowed)"
    [incident] = Journal(run / "journal.sqlite").incidents()
    assert incident["kind"] == "hang"
    return incident["details"]["collectives"]


def test_a_hang_names_the_rank_behind_and_who_waits(tmp_path: Path):
    diag = hang_diagnosis(tmp_path, "--stuck-rank", str(STUCK))
    assert diag["no_dump"] == [] and diag["desync"] == []
    by_group = {(s["group"], *s["ranks"]): s for s in diag["stuck"]}
    dp = by_group["dp", 2, 3]
    assert dp["ranks"] == [2, 3] and dp["seq"] == AT and dp["op"].endswith("all_reduce")
    [missing] = dp["missing"]
    assert missing["rank"] == STUCK and missing["coords"] == {"dp": 1, "pp": 1}
    assert missing["last_seq"] == AT - 1 and missing["where"].startswith("outside any collective")
    assert dp["waiting"] == [2]
    pp = by_group["pp", 1, 3]  # rank 1 waits in the pp group for rank 3 too
    assert pp["waiting"] == [1] and [m["rank"] for m in pp["missing"]] == [STUCK]
    [chained] = by_group["pp", 0, 2]["missing"]  # rank 0 waits for rank 2, itself waiting on rank 3
    assert chained["rank"] == 2 and chained["where"] == f"in dp collective #{AT} (gloo:all_reduce)"
    assert ("dp", 0, 1) not in by_group, "a group whose members all finished is not stuck"
    assert "rank 3 [dp1 pp1]" in diag["summary"] and "never entered" in diag["summary"]


def test_a_different_op_at_the_same_collective_is_a_desync_with_both_fingerprints(tmp_path: Path):
    diag = hang_diagnosis(tmp_path, "--desync-rank", str(STUCK))  # rank 3 broadcasts, rank 2 all-reduces
    assert diag["no_dump"] == []
    [desync] = [d for d in diag["desync"] if d["group"] == "dp"]
    assert desync["seq"] == AT
    prints = {int(r): f for r, f in desync["fingerprints"].items()}
    assert set(prints) == {2, 3}, prints
    assert prints[2]["op"].endswith("all_reduce") and prints[3]["op"].endswith("broadcast"), prints
    assert f"desync in group dp at collective #{AT}" in diag["summary"]
