"""tests/gpu: every test carries the ``gpu`` marker and is skipped, with the reason, without CUDA.

They run where a GPU is (``make gpu-check``, docs/gpu.md); CI collects them and skips them all."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def cuda_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return f"needs CUDA: torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in Path(str(item.path)).parents]
    if not ours:
        return
    reason = cuda_skip_reason()
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
