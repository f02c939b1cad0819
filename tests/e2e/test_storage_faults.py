"""Issue #19's scenario under `stalwart run`: the checkpoint store is a full filesystem.

The `storage` incident reaches the console, the journal and the job report within one persist
interval, no torn step directory is left, the workers are not restarted, and the job ends non-zero
naming the shared-memory copy — which `stalwart ckpt persist-from-memory` commits once space is freed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.checkpoint.storage import Storage
from stalwart.launch.journal import Journal

pytestmark = pytest.mark.e2e


def test_full_store_is_reported_not_restarted_and_the_job_fails_naming_the_memory_copy(stdlib_data, tmp_path):
    store = tmp_path / "fs"
    store.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(store)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip() or 'not permitted'})")
    shm: Path | None = None
    try:
        cmd = [
            *(sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", "2"),
            *("--max-restarts", "2", "--run-dir", str(tmp_path / "run"), "--summary-json", str(tmp_path / "run.json")),
            *("-m", "stalwart", "train", "--config", "configs/debug.toml", f"--data.dir={stdlib_data}"),
            *("--data.seq_len=64", "--train.steps=12", "--train.warmup_steps=2", f"--train.out_dir={tmp_path / 'out'}"),
            *("--checkpoint.enabled=true", f"--checkpoint.dir={store / 'ckpt'}", "--checkpoint.persist_every_steps=4"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        err = proc.stderr
        assert proc.returncode != 0, "the final state is not durable: the job must not succeed"
        assert re.search(r"stalwart: storage full: persist of step \d+ to \S+ failed", err), err[-4000:]
        assert "failed with a storage failure; not restarting" in err and "StorageUnavailableError" in err
        match = re.search(r"`stalwart ckpt persist-from-memory (\S+)`", err)
        assert match, err[-4000:]
        shm = Path(match.group(1))
        run = json.loads((tmp_path / "run.json").read_text())
        assert run["restarts_used"] == 0 and [i["kind"] for i in run["incidents"]] == ["storage"]
        assert run["storage"]["cause"] == "full" and run["storage"]["last_committed"] == -1
        journaled = [i for i in Journal(tmp_path / "run" / "journal.sqlite").incidents() if i["kind"] == "storage"]
        assert journaled[0]["details"]["cause"] == "full" and journaled[0]["details"]["step"] % 4 == 0
        assert not [p for p in (store / "ckpt").iterdir() if p.name.startswith("step-")], "no torn step directory"

        subprocess.run(["mount", "-o", "remount,size=64m", str(store)], check=True)  # space freed
        done = subprocess.run(
            [sys.executable, "-m", "stalwart", "ckpt", "persist-from-memory", str(shm), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert json.loads(done.stdout)["step"] == 12
        storage = Storage(str(store / "ckpt"))
        assert storage.latest() == 12 and storage.verify(12) == []
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
        subprocess.run(["umount", "-l", str(store)], check=False)
