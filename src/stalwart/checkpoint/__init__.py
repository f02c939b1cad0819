"""Flash checkpoints: double-buffered shared-memory snapshots (tier 1) persisted in DCP format by a
keeper process that outlives the workers (tier 2). See docs/checkpoint.md.

    from stalwart.checkpoint import Checkpointer
    ckpt = Checkpointer("runs/x/checkpoints", persist_every_steps=50)
    start = ckpt.restore(state)
    ...; ckpt.save(step, state)
    ckpt.wait(persist=True); ckpt.close()
"""

from stalwart.checkpoint.checkpointer import Checkpointer
from stalwart.checkpoint.node_job import NodeJob, save_on_failure
from stalwart.checkpoint.restore import RestoreInfo
from stalwart.checkpoint.shm import job_dir_for
from stalwart.checkpoint.storage import Storage

__all__ = ["Checkpointer", "NodeJob", "RestoreInfo", "Storage", "job_dir_for", "save_on_failure"]
