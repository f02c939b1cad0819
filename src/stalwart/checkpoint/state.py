"""Collect and apply the training state (docs/checkpoint.md, "Use"), flattened with DCP's own
flattening, so our keys are those ``dcp.load`` derives from the same nested dict.
:meth:`TrainingState.capture` runs at every save, on the training thread: it walks the tensors once
(to notice a replaced one) and otherwise reuses what does not change between steps (DCP's state dicts,
their flattening, the slot layout's signature), as the optimizer updates its tensors in place; only
hyperparameters and small objects are read afresh.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from stalwart._compat import flatten_state_dict, own_members
from stalwart.checkpoint.hparams import PARAM_GROUPS, PARAMS, has_per_parameter_hyperparameters

RNG_KEY = "rng"
Path_ = tuple[str | int, ...]
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)  # per-parameter keys: see hparams
_versions = itertools.count(1)  # tells cached flattenings apart (across TrainingState instances too)


@dataclass
class Captured:
    """One rank's state at one step, split for the snapshot copy: ``tensors`` are live references (plain
    tensors or DTensors) that the background copy reads, and ``sources`` their rank-local data; ``objects``
    deep copies of every non-tensor leaf, taken synchronously (schedulers and samplers change them on the
    very next step); ``groups`` each optimizer's param groups (hyperparameters copied, ``params`` = FQNs),
    spelled out into checkpoint keys only when persisted (:func:`~stalwart.checkpoint.hparams.dcp_hyperparameters`).
    ``signature`` changes whenever the tensors' keys, dtypes or shapes may have: the writer plans the
    slot layout again only then."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    mappings: dict[str, Path_]
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    signature: Hashable = None
    sources: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Part:
    """One item's flattened state; ``version`` is set when it is cached (its tensors follow the live
    ones because the optimizer updates them in place), ``None`` for a part read afresh every save."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    mappings: dict[str, Path_]
    sources: dict[str, torch.Tensor]
    key: Hashable = None
    version: int | None = None
    fqns: list[list[str]] = field(default_factory=list)  # an optimizer's groups' parameter FQNs

    @classmethod
    def of(cls, name: str, sd: Mapping[str, Any]) -> _Part:
        flat, mappings = flatten_state_dict({name: sd})
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        objects = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors, objects, mappings, {k: local_tensor(t) for k, t in tensors.items()})

    def signature(self) -> Hashable:
        if self.version is not None:
            return self.version
        return tuple((k, t.dtype, tuple(t.shape), tuple(self.sources[k].shape)) for k, t in self.tensors.items())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor (the local shard of a DTensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# -- RNG ---------------------------------------------------------------------------------------------
class _RngTensors:
    """numpy's and Python's generator states as tensors, converted again only when they changed (a
    training loop rarely draws from either, and converting 625 integers is a good part of a save call).
    The tensors handed out are never written: a snapshot may still be reading the previous one."""

    def __init__(self) -> None:
        self._numpy: tuple[np.ndarray, torch.Tensor] | None = None
        self._python: tuple[tuple[int, ...], torch.Tensor] | None = None

    def numpy_keys(self, keys: np.ndarray) -> torch.Tensor:
        if self._numpy is None or not np.array_equal(self._numpy[0], keys):
            self._numpy = (keys.copy(), torch.from_numpy(keys.astype(np.int64)))
        return self._numpy[1]

    def python_state(self, internal: tuple[int, ...]) -> torch.Tensor:
        if self._python is None or self._python[0] != internal:
            self._python = (internal, torch.tensor(internal, dtype=torch.int64))
        return self._python[1]


_RNG_TENSORS = _RngTensors()


def rng_state(reuse: bool = True) -> dict[str, Any]:
    """torch/numpy/python (and CUDA) generator states as tensors and plain numbers, so they can be
    stored as DCP items and loaded with ``weights_only=True``. ``reuse``: the numpy and Python states'
    tensors may be the previous call's (never written: a capture's); a load's template must not be."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    assert kind == "MT19937", kind
    version, internal, py_gauss = random.getstate()
    tensors = _RNG_TENSORS if reuse else _RngTensors()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_keys": tensors.numpy_keys(keys),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(gauss),
        "python_state": tensors.python_state(internal),
        "python_version": int(version),
        "python_gauss": py_gauss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].to(torch.uint8))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(
        ("MT19937", keys, int(state["numpy_pos"]), int(state["numpy_has_gauss"]), float(state["numpy_gauss"]))
    )
    internal = tuple(int(x) for x in state["python_state"].tolist())
    random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8))


# -- the user's dict of Stateful things ---------------------------------------------------------------
class TrainingState:
    """Binds ``{"model": model, "optim": optimizer, "sampler": ..., "scheduler": ..., "extra": {...}}``:
    nn.Module → DCP model state dict (DDP, FSDP2, DTensor); Optimizer → DCP optimizer state dict (keyed
    by parameter FQN, so it reshards); objects with ``state_dict``/``load_state_dict`` → theirs; dicts →
    stored as is and updated in place on load. ``rng`` is reserved: this rank's RNG states, ``rng.rank<r>``."""

    def __init__(self, state: Mapping[str, Any], rank: int, rng: bool = True) -> None:
        if not isinstance(state, Mapping) or not state:
            raise ValueError(
                "checkpoint state must be a non-empty dict such as "
                "{'model': model, 'optim': optimizer, 'sampler': sampler}"
            )
        self.rank, self.rng = rank, rng
        self.items = dict(state)
        self._cache: dict[str, _Part] = {}  # model/optimizer parts reused while their tensors stay
        self._modules: dict[str, list[nn.Module]] = {}  # each model's modules, walked again on a change
        modules = {n: v for n, v in self.items.items() if isinstance(v, nn.Module)}
        self.owner: dict[str, nn.Module] = {}
        for name, value in self.items.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"checkpoint state key {name!r}: use a non-empty string without '.'")
            if name == RNG_KEY and rng:
                raise ValueError(f"checkpoint state key {RNG_KEY!r} is reserved for the RNG states")
            if isinstance(value, torch.optim.Optimizer):
                self.owner[name] = self._find_owner(name, value, modules)
            elif not (
                isinstance(value, (nn.Module, dict))
                or (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)))
            ):
                raise ValueError(
                    f"checkpoint state[{name!r}] is a {type(value).__name__}: pass an nn.Module, an Optimizer, "
                    "an object with state_dict()/load_state_dict(), or a dict of extras (updated in place)"
                )

    @staticmethod
    def _find_owner(name: str, optim: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
        first = next((p for g in optim.param_groups for p in g["params"]), None)
        for module in modules.values():
            if first is None or any(p is first for p in module.parameters()):
                return module
        raise ValueError(
            f"optimizer state[{name!r}] updates parameters of no nn.Module in the checkpoint "
            "state; add the model to the same dict"
        )

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [v for v in self.items.values() if isinstance(v, torch.optim.Optimizer)]

    def state_dict(self, for_load: bool = False) -> dict[str, Any]:
        """The nested state dict (optimizers in DCP's flattened form, ``FLAT_OPTIM``). ``for_load``
        allows DCP to initialise an optimizer that has not stepped yet (it runs one zero-lr step),
        which a load needs and a save must never do."""
        out: dict[str, Any] = {}
        for name, value in self.items.items():
            if isinstance(value, torch.optim.Optimizer):
                out[name] = _optimizer_state_dict(self.owner[name], value, for_load, FLAT_OPTIM)
            elif isinstance(value, nn.Module):
                out[name] = get_model_state_dict(value)
            else:
                out[name] = self._plain_state_dict(value)
        if self.rng:  # a load writes into the template: never the tensors a capture shares
            out[RNG_KEY] = {f"rank{self.rank}": rng_state(reuse=not for_load)}
        return out

    @staticmethod
    def _plain_state_dict(value: Any) -> dict[str, Any]:
        return dict(value) if isinstance(value, dict) else value.state_dict()

    def capture(self) -> Captured:
        """This step's state for a snapshot (see the module doc for what is reused)."""
        parts, groups = [], {}
        for name, value in self.items.items():
            if isinstance(value, torch.optim.Optimizer):
                part = self._optimizer_part(name, value)
                groups[name] = _copy_groups(value, part.fqns)
            elif isinstance(value, nn.Module):
                part = self._model_part(name, value)
            else:
                part = _Part.of(name, self._plain_state_dict(value))
            parts.append(part)
        if self.rng:
            parts.append(_Part.of(RNG_KEY, {f"rank{self.rank}": rng_state()}))
        tensors: dict[str, torch.Tensor] = {}
        sources: dict[str, torch.Tensor] = {}
        objects: dict[str, Any] = {}
        mappings: dict[str, Path_] = {}
        for part in parts:
            tensors.update(part.tensors)
            sources.update(part.sources)
            objects.update(part.objects)
            mappings.update(part.mappings)
        return Captured(tensors, copy.deepcopy(objects), mappings, groups, tuple(p.signature() for p in parts), sources)

    def _model_part(self, name: str, model: nn.Module) -> _Part:
        """DCP's model state dict, flattened, reused while the model holds the same parameter and
        buffer tensors: DCP walks every module to map names on each call (milliseconds per save for a
        small model, more for a deep one). A replaced tensor (a load, FSDP resharding) or submodule
        changes the key."""
        modules = self._modules.get(name)
        key = _tree_key(modules) if modules is not None else None
        cached = self._cache.get(name)
        if cached is not None and cached.key == key:
            return cached
        modules = self._modules[name] = list(model.modules())
        key = _tree_key(modules)
        part = _Part.of(name, get_model_state_dict(model))
        if part.objects:  # extra state: not a reference that follows the model
            return part
        part.key, part.version = key, next(_versions)
        self._cache[name] = part
        return part

    def _optimizer_part(self, name: str, optim: torch.optim.Optimizer) -> _Part:
        """DCP's optimizer state (tensors), flattened, and each group's parameter FQNs, reused while
        the optimizer holds the same state tensors (it updates them in place). Hyperparameters are
        not part of it: :func:`_copy_groups` reads them from the live ``param_groups``."""
        key = (len(optim.param_groups), *((id(p), *map(id, st.values())) for p, st in optim.state.items()))
        cached = self._cache.get(name)
        if cached is not None and cached.key == key:
            return cached
        sd = _optimizer_state_dict(self.owner[name], optim, False)
        # keys and paths as DCP's flattened layout (FLAT_OPTIM) has them, so they match the load template
        part = _Part.of(name, {f"state.{fqn}.{k}": v for fqn, st in sd["state"].items() for k, v in st.items()})
        part.fqns = [list(g[PARAMS]) for g in sd[PARAM_GROUPS]]
        assert len(part.fqns) == len(optim.param_groups), "DCP returned a group per optimizer param group"
        if part.objects or not optim.state:  # e.g. a float step counter; or DCP's placeholder before step 1
            return part
        part.key, part.version = key, next(_versions)
        self._cache[name] = part
        return part

    def load(self, nested: Mapping[str, Any]) -> None:
        """Apply a nested state dict (as produced by :meth:`state_dict` and then filled by a load)."""
        for name, value in self.items.items():
            if name not in nested:
                continue
            sd = nested[name]
            if isinstance(value, torch.optim.Optimizer):
                if any(g[PARAMS] for g in value.param_groups) and not has_per_parameter_hyperparameters(sd):
                    raise ValueError(
                        f"the checkpoint holds no hyperparameters of optimizer {name!r} under per-parameter keys "
                        f"({name}.{PARAM_GROUPS}.<parameter>.<name>): it predates the flattened optimizer state "
                        "or packs them (written by an older stalwart, docs/parallelism.md); resume it with the "
                        "stalwart version that wrote it, or point checkpoint.dir elsewhere to start fresh"
                    )
                set_optimizer_state_dict(self.owner[name], value, sd, options=FLAT_OPTIM)
            elif isinstance(value, nn.Module):
                set_model_state_dict(value, sd)
            elif isinstance(value, dict):
                value.update(sd)
            else:
                value.load_state_dict(sd)
        rng = nested.get(RNG_KEY, {}).get(f"rank{self.rank}") if self.rng else None
        if rng is not None:
            set_rng_state(rng)


def _tree_key(modules: list[nn.Module]) -> tuple[Any, ...]:
    """What changes when a module's children, parameters or buffers are replaced, read from each
    module's own dicts (walking ``model.modules()`` afresh costs more than the whole check)."""
    key: list[Any] = []
    for module in modules:
        children, params, buffers = own_members(module)
        key.append(tuple(map(id, children)))
        key.extend(_identity(t) for t in params if t is not None)
        key.extend(_identity(t) for t in buffers if t is not None)
    return tuple(key)


def _identity(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What changes when a live tensor is replaced: the object, its (local) data and shape."""
    local = t.to_local() if isinstance(t, DTensor) else t  # its shard (FSDP may swap it)
    return id(t), local.data_ptr(), local.shape


def _copy_groups(optim: torch.optim.Optimizer, fqns: list[list[str]]) -> list[dict[str, Any]]:
    """The live hyperparameters of each param group (copied: a scheduler changes them next step)
    with the group's parameter FQNs (shared with the cache: never mutated)."""
    return [
        {**copy.deepcopy({k: v for k, v in g.items() if k != PARAMS}), PARAMS: names}
        for g, names in zip(optim.param_groups, fqns)
    ]


def _optimizer_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, for_load: bool, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """DCP's optimizer state dict. DCP initialises an optimizer without state and gradients by
    running a zero-lr step; a load needs that (tensors to load into), a save must not change the
    optimizer, so it shows DCP one placeholder gradient and gets the honest, empty state instead."""
    if for_load or optim.state or any(p.grad is not None for g in optim.param_groups for p in g["params"]):
        return get_optimizer_state_dict(model, optim, options=options)
    first = next(p for g in optim.param_groups for p in g["params"])
    first.grad = torch.empty_like(first)  # never read: DCP only checks `is not None`
    try:
        return get_optimizer_state_dict(model, optim, options=options)
    finally:
        first.grad = None


def set_path(nested: dict[str, Any], path: Path_, value: Any) -> None:
    """Replace the leaf at ``path`` (as in DCP's flatten mapping) in an existing nested structure."""
    node: Any = nested
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
