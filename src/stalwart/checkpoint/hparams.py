"""Where an optimizer's hyperparameters (lr, betas, ...) go: a snapshot keeps each optimizer's param
groups compact, as DCP's nested state dict has them; a checkpoint spells them out under the keys of
both of DCP's layouts (flattened ``<optim>.param_groups.<fqn>.<name>``, what stalwart loads; nested
``<optim>.param_groups.<i>.<name>``), so plain ``dcp.load`` into torch's own templates works. See
docs/parallelism.md, the optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PARAM_GROUPS = "param_groups"
PARAMS = "params"
Path_ = tuple[str | int, ...]


def dcp_hyperparameters(name: str, groups: list[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Path_]]:
    """The checkpoint entries (flat DCP key → value) of optimizer ``name``'s ``groups``, and each
    key's path in the nested state dict (DCP's flatten mapping)."""
    objects: dict[str, Any] = {}
    mappings: dict[str, Path_] = {}
    for index, group in enumerate(groups):
        hyper = [(k, v) for k, v in group.items() if k != PARAMS]
        for fqn in group[PARAMS]:
            for k, v in hyper:
                local = f"{PARAM_GROUPS}.{fqn}.{k}"
                objects[f"{name}.{local}"], mappings[f"{name}.{local}"] = v, (name, local)
        for k, v in [*hyper, (PARAMS, list(group[PARAMS]))]:
            key = f"{name}.{PARAM_GROUPS}.{index}.{k}"
            objects[key], mappings[key] = v, (name, PARAM_GROUPS, index, k)
    return objects, mappings


def has_per_parameter_hyperparameters(optim_state: Mapping[str, Any]) -> bool:
    """True if a flattened optimizer state dict (as filled by a load) holds any hyperparameter."""
    return any(k.startswith(f"{PARAM_GROUPS}.") for k in optim_state)
