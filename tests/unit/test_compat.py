"""Each private torch API in ``stalwart._compat`` still exists and behaves as stalwart assumes.

A failure here means the installed torch changed an internal stalwart relies on: fix ``_compat``.
"""

from __future__ import annotations

import torch

from stalwart import _compat


def test_torch_version_in_supported_range() -> None:
    low, high = (tuple(int(x) for x in v.split(".")) for v in _compat.SUPPORTED_TORCH)
    assert low <= tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) <= high


# --- elastic agent, launcher, process helpers -------------------------------------------------


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint -------------------------------------------------------------------


# --- end of distributed checkpoint section ----------------------------------------------------


# --- device mesh (torch.distributed.device_mesh) ---------------------------------------------

def test_flatten_mesh_and_slice_with_a_flattened_axis() -> None:
    """``DeviceMesh._flatten`` makes a named axis of several; the root mesh can then be sliced by it,
    alone or with another axis (HSDP), without a warning escaping. World of one process (gloo)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("rep", "shard_a", "shard_b"))
        flat = _compat.flatten_mesh(mesh, ("shard_a", "shard_b"), "shard")
        assert isinstance(flat, DeviceMesh) and flat.mesh_dim_names == ("shard",) and flat.size() == 1
        assert flat.get_group() is not None and flat.get_local_rank() == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            both = _compat.slice_flattened(mesh, ("rep", "shard"))
        assert both.mesh_dim_names == ("rep", "shard") and both.shape == (1, 1)
    finally:
        if owned:
            dist.destroy_process_group()


# --- end of device mesh section ---------------------------------------------------------------


# --- training ---------------------------------------------------------------------------------


# --- end of training section ------------------------------------------------------------------
