"""Every private PyTorch API stalwart relies on, in one place.

Supported torch range: see ``SUPPORTED_TORCH`` (pyproject.toml pins the tested bounds). Each
reach-in below has a test in ``tests/unit/test_compat.py`` that fails loudly when torch changes it,
so a torch upgrade breaks one module and one test file, not the agent or the checkpoint at run time.
Nothing outside this module imports a private torch name (``torch.*._x``) or patches a torch object.
"""

from __future__ import annotations

SUPPORTED_TORCH = ("2.11", "2.13")  # lowest and highest minor version tested

# --- elastic agent, launcher, process helpers (torch.distributed.elastic / launcher) ---------------


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint (torch.distributed.checkpoint) -----------------------------------------


# --- end of distributed checkpoint section ----------------------------------------------------


# --- device mesh (torch.distributed.device_mesh) ---------------------------------------------


# --- end of device mesh section ---------------------------------------------------------------


# --- training (determinism, activation checkpointing) --------------------------------------------
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    _CHECKPOINT_PREFIX as CHECKPOINT_WRAPPER_PREFIX,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402, F401


def set_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` without its import of ``torch._inductor`` (only to
    set inductor's own flag; 2–3 s of every worker start, so of every recovery, on torch 2.13). The
    trainer does not compile; if something already imported inductor, the public call is used."""
    import sys

    import torch

    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=False)
    else:
        torch._C._set_deterministic_algorithms(True, warn_only=False)



# --- end of training section ------------------------------------------------------------------
