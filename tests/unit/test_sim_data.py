"""The simulator data shipped as package data (stalwart/sched/data): what ships matches its SHA256SUMS
and carries its licence and provenance, ``stalwart sim`` runs on it alone (no ``../shared`` beside
the checkout), and a user-given data root that lacks a file says so."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import stalwart
from stalwart.cli import main
from stalwart.sched.elasticflow_trace import DEFAULT_DATA_ROOT as ELASTICFLOW
from stalwart.sched.elasticflow_trace import load_trace
from stalwart.sched.pollux_workload import DEFAULT_ROOT as POLLUX
from stalwart.sched.traces import DEFAULT_TRACES

PACKAGE = Path(stalwart.__file__).resolve().parent
DATA = PACKAGE / "sched" / "data"
META = {"PROVENANCE.md", "SHA256SUMS"}


def _sums(root: Path) -> dict[str, str]:
    """``{upstream path: sha256}`` from ``root/SHA256SUMS`` (the ``sha256sum`` format)."""
    out = {}
    for line in (root / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        out[name.lstrip("*")] = digest
    return out


@pytest.mark.parametrize("source", ["elasticflow", "pollux"])
def test_shipped_files_match_their_sha256sums_and_carry_licence_and_provenance(source: str):
    root = DATA / source
    sums = _sums(root)
    shipped = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - META
    listed = set()
    for name, digest in sums.items():
        path = root / name if (root / name).exists() else root / f"{name}.gz"
        assert path.exists(), f"{source}: {name} is in SHA256SUMS but not shipped"
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{source}: {name} does not match SHA256SUMS"
        listed.add(path.relative_to(root).as_posix())
    assert shipped == listed, f"{source}: shipped but not in SHA256SUMS: {sorted(shipped - listed)}"
    assert any(n.startswith("LICENSE") for n in listed), f"{source} ships no licence"
    provenance = (root / "PROVENANCE.md").read_text()
    assert "github.com" in provenance and "commit" in provenance
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < 3_000_000, "keep the package small"


def test_the_default_data_roots_are_the_package_data_and_pyproject_ships_it():
    for root in (ELASTICFLOW, POLLUX, DEFAULT_TRACES):
        assert root.is_dir() and root.is_relative_to(DATA), root
    pyproject = PACKAGE.parents[1] / "pyproject.toml"
    if pyproject.exists():  # a source checkout: the wheel must carry the data (not checked when installed)
        globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["stalwart"]
        assert "sched/data/**/*" in globs


def test_sim_runs_from_a_folder_with_no_shared_data_beside_it(tmp_path: Path):
    work = tmp_path / "clone" / "elsewhere"
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}

    def sim(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "stalwart", "sim", *args]
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)

    helped = sim("pollux", "--help")
    assert helped.returncode == 0 and "--data" in helped.stdout, helped.stderr
    ran = sim("elasticflow", "--traces", "10", "--policies", "edf", "--json")
    assert ran.returncode == 0, ran.stderr
    [row] = json.loads(ran.stdout)["results"]
    assert row["trace"] == "cluster10" and row["jobs"] == 260 and 0 < row["dsr"] < 1
    ran = sim("pollux", "--traces", "3", "--policies", "tiresias", "--json")
    assert ran.returncode == 0, ran.stderr
    [row] = json.loads(ran.stdout)["results"]
    assert row["trace"] == "workload-3" and row["jobs"] == row["finished"] == 160
    assert not (tmp_path / "clone" / "shared").exists()


def test_a_user_data_root_with_plain_csv_reads_the_same_and_a_missing_file_is_named(tmp_path: Path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "cluster10.csv").write_bytes(gzip.decompress((ELASTICFLOW / "traces" / "cluster10.csv.gz").read_bytes()))
    shutil.copytree(ELASTICFLOW / "throughputs_A100", tmp_path / "throughputs_A100")
    assert load_trace("cluster10", tmp_path) == load_trace("cluster10")
    with pytest.raises(ValueError, match=r"neither cluster04\.csv nor cluster04\.csv\.gz"):
        load_trace("cluster04", tmp_path)
    from stalwart.sched.pollux_sim import simulate

    with pytest.raises(ValueError, match="no workload"):
        simulate(1, "fifo", data_root=tmp_path)
    assert main(["sim", "pollux", "--data", str(tmp_path)]) == 2
    assert "has no workloads/ folder" in capsys.readouterr().err
