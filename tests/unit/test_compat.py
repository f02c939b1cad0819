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


# --- end of device mesh section ---------------------------------------------------------------


# --- training ---------------------------------------------------------------------------------


# --- end of training section ------------------------------------------------------------------
