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
def test_checkpoint_wrapper_prefix_is_what_named_parameters_show() -> None:
    """Per-parameter init maps wrapped names back to the model's own by removing this prefix."""
    block = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrapped = torch.nn.ModuleDict({"0": _compat.checkpoint_wrapper(block, preserve_rng_state=False)})
    names = [n for n, _ in wrapped.named_parameters()]
    assert names == [f"0.{_compat.CHECKPOINT_WRAPPER_PREFIX}0.weight", f"0.{_compat.CHECKPOINT_WRAPPER_PREFIX}0.bias"]
    assert set(wrapped.state_dict()) == {"0.0.weight", "0.0.bias"}, "the wrapper hides itself from state_dict"


def test_set_deterministic_algorithms_sets_the_public_flag() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        _compat.set_deterministic_algorithms()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before)



# --- end of training section ------------------------------------------------------------------
