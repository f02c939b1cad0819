"""The one DeviceMesh that carries a :class:`~stalwart.plan.parallel.Layout`, and its named axes.

:func:`build_mesh` makes one ``DeviceMesh`` with the named axes
``("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")`` (``MESH_DIMS``; size-1 axes are kept so
code can slice any axis by name) and the flattened axes ``"dp_shard"`` (= dp_shard_mod_ep × ep) and
``"dp"`` (= dp_replicate × dp_shard), the axis that decides which data a rank reads. It returns a
:class:`Mesh` that owns both, so the flattened sub-meshes live exactly as long as the mesh (no global
cache). Choosing the layout is the planner's job (``stalwart.plan``); this module only builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from stalwart._compat import flatten_mesh, slice_flattened
from stalwart.dist import PG_TIMEOUT_S
from stalwart.plan.parallel import CP_UNSUPPORTED, MESH_DIMS, Layout


@dataclass(frozen=True, eq=False)
class Mesh:
    """The job's DeviceMesh plus its flattened axes; ``mesh["dp"]``, ``mesh["pp"]`` or
    ``mesh["dp_replicate", "dp_shard"]`` is the sub-mesh of those axes."""

    device_mesh: DeviceMesh
    flat: Mapping[str, DeviceMesh]  # "dp_shard", "dp", "dp_replicate,dp_shard"

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        key = ",".join(names)
        if key in self.flat:
            return self.flat[key]
        return self.device_mesh[names[0]] if len(names) == 1 else self.device_mesh[names]


def build_mesh(layout: Layout, device_type: str | None = None) -> Mesh:
    """One DeviceMesh over the whole job with MESH_DIMS plus flattened "dp_shard" and "dp"."""
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed first (stalwart.dist.init_distributed)")
    if layout.cp > 1:
        raise ValueError(CP_UNSUPPORTED)
    layout.check_world(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    layout.check_device(str(dist.get_backend()), device_type)
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    flat = {
        "dp_shard": flatten_mesh(mesh, ("dp_shard_mod_ep", "ep"), "dp_shard"),
        "dp": flatten_mesh(mesh, ("dp_replicate", "dp_shard_mod_ep", "ep"), "dp"),
    }
    flat["dp_replicate,dp_shard"] = slice_flattened(mesh, ("dp_replicate", "dp_shard"))
    return Mesh(mesh, flat)


def axis(mesh: Mesh, *names: str) -> DeviceMesh:
    """Sub-mesh of ``mesh`` (from build_mesh) by axis name(s), flattened axes included: "dp",
    "dp_shard", ("dp_replicate", "dp_shard") or any of MESH_DIMS."""
    return mesh[names]


@dataclass(frozen=True)
class Coords:
    """This rank's position: which data it reads (dp) and which stage it runs (pp)."""

    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int


def coords(mesh: Mesh) -> Coords:
    dp, pp, tp = mesh["dp"], mesh["pp"], mesh["tp"]
    return Coords(dp.get_local_rank(), dp.size(), pp.get_local_rank(), pp.size(), tp.get_local_rank(), tp.size())


def tp_data_group(mesh: Mesh) -> tuple[dist.ProcessGroup | None, int]:
    """A gloo group over this rank's tensor-parallel group and its first rank: the one that reads the
    (identical) batch for all of them (None when tp = 1). Every rank creates every TP group's, in order."""
    dm = mesh.device_mesh
    names = list(dm.mesh_dim_names or ())
    if "tp" not in names or dm.mesh.shape[names.index("tp")] == 1:
        return None, 0
    ranks = dm.mesh.movedim(names.index("tp"), -1).reshape(-1, dm.mesh.shape[names.index("tp")]).tolist()
    timeout = timedelta(seconds=PG_TIMEOUT_S)  # gloo's own default is 30 min: a hung peer would stall reads that long
    group, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout, backend="gloo")
    return group, next(g[0] for g in ranks if dist.get_rank() in g)
