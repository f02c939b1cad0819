"""Flash checkpoints: double-buffered shared-memory snapshots (tier 1) persisted in DCP format by a
keeper process that outlives the workers (tier 2). See docs/checkpoint.md.

    from stalwart.checkpoint import Checkpointer
    ckpt = Checkpointer("runs/x/checkpoints", persist_every_steps=50)
    start = ckpt.restore(state)            # {"model": model, "optim": optimizer, "sampler": ..., ...}
    for step in range(start + 1, steps + 1):
        train_step(); ckpt.save(step, state)   # after optimizer.step(); copied in the background
    ckpt.wait(persist=True); ckpt.close()

The names below load on first use (PEP 562), so the job master can host the torch-free decider
(``stalwart.checkpoint.decider``) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Checkpointer": "checkpointer",
    "NodeJob": "node_job",
    "save_on_failure": "node_job",
    "RestoreInfo": "restore",
    "job_dir_for": "shm",
    "Storage": "storage",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
