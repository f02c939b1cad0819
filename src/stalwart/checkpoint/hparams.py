"""Where an optimizer's hyperparameters (lr, betas, ...) go in a checkpoint.

A snapshot keeps them compact: per optimizer, its param groups as DCP's nested state dict has them
(each group's hyperparameters, and ``params``: the FQNs of its parameters) — one small object per
group, copied at every save. A checkpoint spells them out under the keys of *both* of DCP's
optimizer layouts, so plain ``dcp.load`` into torch's own ``get_state_dict(model, optim)`` template
works, nested or with ``StateDictOptions(flatten_optimizer_state_dict=True)``:

- flattened: ``<optim>.param_groups.<fqn>.<name>``, one per parameter — what stalwart itself loads:
  every key names its parameter, so pipeline stages (which hold different parameters) never collide;
- nested: ``<optim>.param_groups.<i>.<name>`` and ``<optim>.param_groups.<i>.params`` — keyed by
  group index, so under pipeline parallelism one stage's copy wins; only torch's nested template
  reads them (DCP ignores keys a template lacks).

Optimizer *state* tensors (``<optim>.state.<fqn>.exp_avg``) have the same key in both layouts.
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
