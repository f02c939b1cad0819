"""Shared fixtures: one prepared copy of the built-in corpus per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stalwart.data import ensure_default_corpus

    return ensure_default_corpus(tmp_path_factory.mktemp("data") / "stdlib-byte")
