"""Every private PyTorch API stalwart relies on, in one place.

Supported torch range: see ``SUPPORTED_TORCH`` (pyproject.toml pins the tested bounds). Each
reach-in below has a test in ``tests/unit/test_compat.py`` that fails loudly when torch changes it,
so a torch upgrade breaks one module and one test file, not the agent or the checkpoint at run time.
Nothing outside this module imports a private torch name (``torch.*._x``) or patches a torch object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SUPPORTED_TORCH = ("2.11", "2.13")  # lowest and highest minor version tested

# --- elastic agent, launcher, process helpers (torch.distributed.elastic / launcher) ---------------


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint (torch.distributed.checkpoint) -----------------------------------------


# --- end of distributed checkpoint section ----------------------------------------------------


# --- device mesh (torch.distributed.device_mesh) ---------------------------------------------

def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The axes ``dims`` of ``mesh`` as one axis called ``name`` (FSDP2/HSDP need "dp_shard" and "dp" as
    single axes). ``DeviceMesh._flatten`` is private in torch 2.11 and 2.13 (torchtitan relies on it too);
    same signature in both, so no version branch."""
    return mesh[dims]._flatten(name)


def slice_flattened(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """``mesh[dims]`` where some of ``dims`` were made by :func:`flatten_mesh` (HSDP's
    (dp_replicate, dp_shard) mesh). Torch 2.11 and 2.13 allow it with a deprecation warning and no
    public replacement; the warning is silenced here, and test_compat fails once torch removes it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mesh[dims]


# --- end of device mesh section ---------------------------------------------------------------


# --- training (determinism, activation checkpointing) --------------------------------------------


# --- end of training section ------------------------------------------------------------------
