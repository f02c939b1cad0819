"""Flash checkpoints for the trainers people already use (docs/integrations.md).

    from stalwart.integrations.hf import StalwartCallback            # Hugging Face Trainer (extra "hf")
    from stalwart.integrations.lightning import StalwartCheckpoint   # Lightning (extra "lightning")
    from stalwart.integrations.fabric import StalwartFabric          # Lightning Fabric (extra "lightning")

Each submodule imports its framework when it is imported itself; this package imports neither, so
stalwart never depends on them.
"""

from stalwart.integrations.common import Snapshots

__all__ = ["Snapshots"]
