"""Collect and apply the training state: model and optimizer through DCP's ``get_state_dict`` /
``set_state_dict`` (so DDP, FSDP2 and DTensor states work), other ``Stateful`` objects through
``state_dict``/``load_state_dict``, plain dicts as user extras, plus this rank's RNG states.

The nested state dict is flattened with DCP's own flattening, so the keys we write into a checkpoint
are exactly the keys ``torch.distributed.checkpoint.load`` derives from the same nested dict.

Optimizer states use DCP's *flattened* form (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): every
key names its parameter. The nested form keys hyperparameters by group index (``param_groups.0.*``,
with the group's parameter list as one object), which is per rank under pipeline parallelism — stages
hold different parameters — so a checkpoint could keep only one stage's groups and the others failed
to load (``KeyError: 'betas'``). One parameter's hyperparameters are stored as one object,
``param_groups.<fqn>`` = ((name, value), ...), not one per name: a dozen times fewer small objects to
copy at every snapshot and to write at every persist.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

# DCP's flattening is private API; torch is pinned (constraints.txt) and the keys must match DCP's.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _flatten_optim_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

RNG_KEY = "rng"
Path_ = tuple[str | int, ...]
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)  # per-parameter keys: see the module doc
_PG_PREFIX = "param_groups."


@dataclass
class Captured:
    """One rank's state at one step, split for the snapshot copy.

    ``tensors`` are live references (plain tensors or DTensors) that the background copy reads;
    ``objects`` are deep copies of every non-tensor leaf, taken synchronously, because schedulers and
    samplers change them on the very next step.
    """

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    mappings: dict[str, Path_]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor (the local shard of a DTensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# -- RNG ---------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """torch/numpy/python (and CUDA) generator states as tensors and plain numbers, so they can be
    stored as DCP items and loaded with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    assert kind == "MT19937", kind
    version, internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": int(pos), "numpy_has_gauss": int(has_gauss), "numpy_gauss": float(gauss),
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_version": int(version), "python_gauss": py_gauss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].to(torch.uint8))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), int(state["numpy_has_gauss"]),
                         float(state["numpy_gauss"])))
    internal = tuple(int(x) for x in state["python_state"].tolist())
    random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))


# -- the user's dict of Stateful things ---------------------------------------------------------------
class TrainingState:
    """Binds ``{"model": model, "optim": optimizer, "sampler": ..., "scheduler": ..., "extra": {...}}``.

    nn.Module → DCP model state dict; Optimizer → DCP optimizer state dict (keyed by parameter FQN,
    so it reshards); objects with ``state_dict``/``load_state_dict`` → theirs; dicts → stored as is and
    updated in place on load. ``rng`` is reserved: this rank's RNG states go there as ``rng.rank<r>``.
    """

    def __init__(self, state: Mapping[str, Any], rank: int, rng: bool = True) -> None:
        if not isinstance(state, Mapping) or not state:
            raise ValueError("checkpoint state must be a non-empty dict such as "
                             "{'model': model, 'optim': optimizer, 'sampler': sampler}")
        self.rank, self.rng = rank, rng
        self.items = dict(state)
        self._model_cache: dict[str, tuple[tuple[tuple[int, int], ...], dict[str, Any]]] = {}
        self._optim_cache: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        modules = {n: v for n, v in self.items.items() if isinstance(v, nn.Module)}
        self.owner: dict[str, nn.Module] = {}
        for name, value in self.items.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"checkpoint state key {name!r}: use a non-empty string without '.'")
            if name == RNG_KEY and rng:
                raise ValueError(f"checkpoint state key {RNG_KEY!r} is reserved for the RNG states")
            if isinstance(value, torch.optim.Optimizer):
                self.owner[name] = self._find_owner(name, value, modules)
            elif not (isinstance(value, (nn.Module, dict))
                      or (callable(getattr(value, "state_dict", None))
                          and callable(getattr(value, "load_state_dict", None)))):
                raise ValueError(
                    f"checkpoint state[{name!r}] is a {type(value).__name__}: pass an nn.Module, an Optimizer, "
                    "an object with state_dict()/load_state_dict(), or a dict of extras (updated in place)")

    @staticmethod
    def _find_owner(name: str, optim: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
        first = next((p for g in optim.param_groups for p in g["params"]), None)
        for module in modules.values():
            if first is None or any(p is first for p in module.parameters()):
                return module
        raise ValueError(f"optimizer state[{name!r}] updates parameters of no nn.Module in the checkpoint "
                         "state; add the model to the same dict")

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [v for v in self.items.values() if isinstance(v, torch.optim.Optimizer)]

    def state_dict(self, for_load: bool = False) -> dict[str, Any]:
        """The nested state dict. ``for_load`` allows DCP to initialise an optimizer that has not
        stepped yet (it runs one zero-lr step), which a load needs and a save must never do."""
        out: dict[str, Any] = {}
        for name, value in self.items.items():
            if isinstance(value, torch.optim.Optimizer):
                out[name] = self._optimizer_state_dict(name, value, for_load)
            elif isinstance(value, nn.Module):
                out[name] = self._model_state_dict(name, value) if not for_load else get_model_state_dict(value)
            elif isinstance(value, dict):
                out[name] = dict(value)
            else:
                out[name] = value.state_dict()
        if self.rng:
            out[RNG_KEY] = {f"rank{self.rank}": rng_state()}
        return out

    def _model_state_dict(self, name: str, model: nn.Module) -> dict[str, Any]:
        """DCP's model state dict, reused while the model holds the same parameter and buffer tensors.
        DCP walks every module to map names on each call (milliseconds per save for a small model,
        more for a deep one); the optimizer updates parameters in place, so the tensors it returned
        still show the current values. A replaced tensor (a load, FSDP resharding) changes the key."""
        key = tuple((id(t), _storage_ptr(t)) for t in (*model.parameters(), *model.buffers()))
        cached = self._model_cache.get(name)
        if cached is None or cached[0] != key:
            sd = get_model_state_dict(model)
            if any(not isinstance(v, torch.Tensor) for v in sd.values()):  # extra state: not cacheable
                return sd
            cached = self._model_cache[name] = (key, sd)
        return dict(cached[1])

    def _optimizer_state_dict(self, name: str, optim: torch.optim.Optimizer, for_load: bool = False
                              ) -> dict[str, Any]:
        """DCP's flattened optimizer state dict (``FLAT_OPTIM``) with packed hyperparameters."""
        return pack_hyperparameters(_flatten_optim_state_dict(self._nested_optimizer_state_dict(name, optim, for_load)))

    def _nested_optimizer_state_dict(self, name: str, optim: torch.optim.Optimizer, for_load: bool) -> dict[str, Any]:
        """DCP's nested optimizer state dict, reused while the optimizer holds the same state tensors
        (it updates them in place); hyperparameters (lr, ...) are read fresh from ``param_groups``."""
        if for_load or not optim.state:
            return _optimizer_state_dict(self.owner[name], optim, for_load)
        key = (len(optim.param_groups), *((id(p), *(id(v) for v in st.values())) for p, st in optim.state.items()))
        cached = self._optim_cache.get(name)
        if cached is None or cached[0] != key:
            sd = _optimizer_state_dict(self.owner[name], optim, False)
            tensors_only = all(isinstance(v, torch.Tensor) for st in sd["state"].values() for v in st.values())
            if not tensors_only or len(sd["param_groups"]) != len(optim.param_groups):
                return sd  # e.g. a float step counter: not a reference that follows the optimizer
            cached = self._optim_cache[name] = (key, sd)
        sd = cached[1]
        # fresh group dicts: flattening pops their "params", the cached ones must stay whole
        groups = [{**g, **{k: v for k, v in live.items() if k != "params"}}
                  for g, live in zip(sd["param_groups"], optim.param_groups)]
        return {"state": sd["state"], "param_groups": groups}

    def capture(self) -> Captured:
        flat, mappings = flatten_state_dict(self.state_dict())
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        objects = copy.deepcopy({k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)})
        return Captured(tensors, objects, mappings)

    def load(self, nested: Mapping[str, Any]) -> None:
        """Apply a nested state dict (as produced by :meth:`state_dict` and then filled by a load)."""
        for name, value in self.items.items():
            if name not in nested:
                continue
            sd = nested[name]
            if isinstance(value, torch.optim.Optimizer):
                if any(g["params"] for g in value.param_groups) and not any(k.startswith(_PG_PREFIX) for k in sd):
                    raise ValueError(
                        f"the checkpoint holds no hyperparameters of optimizer {name!r} under per-parameter keys "
                        f"({name}.{_PG_PREFIX}<parameter>): it predates the flattened optimizer state "
                        "(docs/parallelism.md); resume it with the stalwart version that wrote it, or point "
                        "checkpoint.dir elsewhere to start fresh")
                set_optimizer_state_dict(self.owner[name], value, unpack_hyperparameters(sd), options=FLAT_OPTIM)
            elif isinstance(value, nn.Module):
                set_model_state_dict(value, sd)
            elif isinstance(value, dict):
                value.update(sd)
            else:
                value.load_state_dict(sd)
        rng = nested.get(RNG_KEY, {}).get(f"rank{self.rank}") if self.rng else None
        if rng is not None:
            set_rng_state(rng)


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: its shard
    return local.untyped_storage().data_ptr() if local.numel() else 0


def _optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, for_load: bool) -> dict[str, Any]:
    """DCP's nested optimizer state dict. DCP initialises an optimizer without state and gradients by
    running a zero-lr step; a load needs that (tensors to load into), a save must not change the
    optimizer, so it shows DCP one placeholder gradient and gets the honest, empty state instead."""
    if for_load or optim.state or any(p.grad is not None for g in optim.param_groups for p in g["params"]):
        return get_optimizer_state_dict(model, optim)
    first = next(p for g in optim.param_groups for p in g["params"])
    first.grad = torch.empty_like(first)  # never read: DCP only checks `is not None`
    try:
        return get_optimizer_state_dict(model, optim)
    finally:
        first.grad = None


def pack_hyperparameters(flat: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flattened optimizer dict with the ``param_groups.<fqn>.<name>`` entries of one parameter
    merged into ``param_groups.<fqn>`` = ((name, value), ...) (a tuple: DCP stores it as one item)."""
    out: dict[str, Any] = {}
    packed: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat.items():
        if key.startswith(_PG_PREFIX):
            param, _, name = key.rpartition(".")
            packed.setdefault(param, []).append((name, value))
        else:
            out[key] = value
    return out | {param: tuple(pairs) for param, pairs in packed.items()}


def unpack_hyperparameters(packed: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`pack_hyperparameters`: the dict ``set_optimizer_state_dict`` takes."""
    out: dict[str, Any] = {}
    for key, value in packed.items():
        if key.startswith(_PG_PREFIX):
            out.update((f"{key}.{name}", v) for name, v in value)
        else:
            out[key] = value
    return out


def set_path(nested: dict[str, Any], path: Path_, value: Any) -> None:
    """Replace the leaf at ``path`` (as in DCP's flatten mapping) in an existing nested structure."""
    node: Any = nested
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
