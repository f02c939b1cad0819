"""Shared fixtures: one prepared copy of the built-in corpus per test session; private /dev/shm roots."""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stalwart.data import ensure_default_corpus

    return ensure_default_corpus(tmp_path_factory.mktemp("data") / "stdlib-byte")


@pytest.fixture(scope="module")
def shm_root() -> Path:
    """A private /dev/shm root for one test module's jobs; keepers started under it are killed after."""
    root = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    from stalwart.checkpoint.shm import user_dir

    for status in user_dir(root).glob("*/keeper.json"):
        try:
            os.kill(int(json.loads(status.read_text())["pid"]), signal.SIGKILL)
        except (ProcessLookupError, KeyError, TypeError, ValueError):
            pass
    shutil.rmtree(root, ignore_errors=True)
