"""The parallel layout and the one DeviceMesh that carries it.

A :class:`Layout` names the degree of every axis: ``dp_replicate`` (DDP / HSDP replicas),
``dp_shard`` (FSDP2 shards), ``tp`` (tensor + sequence parallel), ``pp`` (pipeline stages), ``ep``
(expert parallel, carved out of ``dp_shard`` as in torchtitan) and ``cp`` (context parallel,
reserved: it cannot run on CPU in torch 2.13, see docs/parallelism.md). The world is
``pp × dp_replicate × dp_shard × cp × tp`` ranks, in that order from slowest to fastest varying, so
that TP groups are the closest ranks (one node) and PP groups the farthest (Megatron-LM's order).

:func:`build_mesh` makes one ``DeviceMesh`` with the named axes
``("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")`` and the flattened axes
``"dp_shard"`` (= dp_shard_mod_ep × ep) and ``"dp"`` (= dp_replicate × dp_shard), the axis that
decides which data a rank reads. Size-1 axes are kept so code can slice any axis by name.

:func:`auto_layout` asks the planner (``stalwart.plan.layout.search``) for the fastest layout that
fits, restricted to what this package can build, and explains the choice.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
CP_UNSUPPORTED = ("context parallel (cp > 1) is not supported: torch 2.13 has no CPU sharding strategy "
                  "for scaled_dot_product_attention, and it has not been verified on a GPU here; "
                  "keep cp = 1 (the mesh axis is reserved)")


@dataclass(frozen=True)
class Layout:
    """Degrees of each parallel axis; their product (ep excluded) is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{key} must be a positive integer, got {value!r}")
        if self.cp > 1:
            raise ValueError(CP_UNSUPPORTED)
        if self.dp_shard % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard}: expert "
                             f"parallelism is carved out of the FSDP shard group; set dp_shard to a multiple "
                             f"of {self.ep}")

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in MESH_DIMS order."""
        return (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)

    @property
    def uses_ddp(self) -> bool:
        """Pure replication is DDP (which supports the gradient compression hooks); any other
        data parallelism composed with TP/PP/EP is FSDP2 (HSDP when dp_replicate > 1)."""
        return (self.dp_replicate > 1 and self.dp_shard == 1 and self.tp == 1 and self.pp == 1
                and self.ep == 1)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in asdict(self).items() if v > 1]
        return " × ".join(parts) if parts else "single rank"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    # -- checks -----------------------------------------------------------------------------------
    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"layout {self.describe()} needs pp×dp_replicate×dp_shard×cp×tp = {self.world_size} ranks "
                f"but the job has {world_size}; change the degrees or the number of processes")

    def check_model(self, args: Any, moe: Any = None, virtual_stages: int = 1) -> None:
        """Raise ValueError when the model cannot be split this way (``args``: ModelArgs)."""
        if self.tp > 1:
            if args.n_heads % self.tp or args.kv_heads % self.tp:
                raise ValueError(
                    f"parallel.tp={self.tp} must divide model.n_heads={args.n_heads} and "
                    f"model.n_kv_heads={args.kv_heads} (each TP rank owns whole heads); use tp in "
                    f"{_common_divisors(args.n_heads, args.kv_heads)}")
            if args.hidden % self.tp:
                raise ValueError(f"parallel.tp={self.tp} must divide the feed-forward hidden size {args.hidden}")
            if moe is not None:
                raise ValueError("tensor parallelism of MoE blocks is not implemented; use ep (expert "
                                 "parallel) with dp_shard, or pp, for MoE models and keep tp = 1")
            if args.pos != "rope":
                raise ValueError(f"tensor parallelism supports RoPE models only (model.pos={args.pos!r}); "
                                 "learned/ALiBi positions would need their own sequence-parallel plan")
        if args.tie_embeddings and (self.tp > 1 or self.pp > 1):
            raise ValueError("tensor and pipeline parallelism need untied embeddings (the embedding and the "
                             "head are split differently / live on different stages); set "
                             "model.tie_embeddings = false")
        stages = self.pp * virtual_stages
        if stages > args.n_layers:
            raise ValueError(
                f"pp={self.pp} × virtual_stages={virtual_stages} = {stages} pipeline stages but the model "
                f"has only {args.n_layers} layers; every stage needs at least one layer")
        if self.ep > 1:
            if moe is None:
                raise ValueError(f"parallel.ep={self.ep} needs a mixture-of-experts model (e.g. "
                                 f"model.name = 'debug-moe'); use ep = 1 for a dense model")
            if moe.num_experts % self.ep:
                raise ValueError(f"parallel.ep={self.ep} must divide the expert count {moe.num_experts}")


def _common_divisors(a: int, b: int) -> list[int]:
    return [d for d in range(1, math.gcd(a, b) + 1) if a % d == 0 and b % d == 0]


_KEYS = {"dp", "dp_replicate", "dp_shard", "tp", "pp", "ep", "cp"}


def layout_from_config(value: dict[str, int] | Layout, world_size: int, dp_mode: str = "fsdp") -> Layout:
    """``{dp=.., tp=.., pp=.., ep=..}`` → Layout. ``dp`` means dp_shard (FSDP2) unless ``dp_mode`` is
    "ddp"; a missing dp is whatever the world leaves after tp × pp × cp. ``"auto"`` is handled by
    :func:`auto_layout` instead."""
    if isinstance(value, Layout):
        value.check_world(world_size)
        return value
    if isinstance(value, str):
        raise ValueError(f"parallel = {value!r}: use a table like {{dp=2, tp=2}} or call auto_layout for 'auto'")
    unknown = set(value) - _KEYS
    if unknown:
        raise ValueError(f"unknown parallel keys {sorted(unknown)}; known: {', '.join(sorted(_KEYS))}")
    if dp_mode not in ("ddp", "fsdp"):
        raise ValueError(f"dp_mode must be ddp or fsdp, got {dp_mode!r}")
    v = {k: int(x) for k, x in value.items()}
    for k, x in v.items():
        if x < 1:
            raise ValueError(f"parallel.{k} must be ≥ 1, got {x}")
    tp, pp, cp, ep = v.get("tp", 1), v.get("pp", 1), v.get("cp", 1), v.get("ep", 1)
    inner = tp * pp * cp
    if world_size % inner:
        raise ValueError(f"tp×pp×cp = {inner} does not divide the {world_size} ranks of the job")
    if "dp" in v and ("dp_replicate" in v or "dp_shard" in v):
        raise ValueError("give either parallel.dp or parallel.dp_replicate/dp_shard, not both")
    if "dp_replicate" in v or "dp_shard" in v:
        rep = v.get("dp_replicate", 0)
        shard = v.get("dp_shard", 0)
        free = world_size // inner
        if not rep:
            rep = max(1, free // shard) if shard else 1
        if not shard:
            shard = max(1, free // rep)
    else:
        dp = v.get("dp", world_size // inner)
        rep, shard = (dp, 1) if dp_mode == "ddp" and ep == 1 else (1, dp)
    layout = Layout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, ep=ep, cp=cp)
    layout.check_world(world_size)
    return layout


# -- the mesh --------------------------------------------------------------------------------------
def build_mesh(layout: Layout, device_type: str | None = None) -> DeviceMesh:
    """One DeviceMesh over the whole job with MESH_DIMS plus flattened "dp_shard" and "dp"."""
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed first (stalwart.dist.init_distributed)")
    layout.check_world(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    flat = {"dp_shard": mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard"),
            "dp": mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")}
    with warnings.catch_warnings():  # 2-D slice with a flattened axis (HSDP); no other way in 2.13
        warnings.simplefilter("ignore", UserWarning)
        flat["dp_replicate,dp_shard"] = mesh["dp_replicate", "dp_shard"]
    _FLAT[id(mesh)] = flat
    return mesh


_FLAT: dict[int, dict[str, DeviceMesh]] = {}


def axis(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """Sub-mesh of ``mesh`` (from build_mesh) by axis name(s), flattened axes included: "dp",
    "dp_shard", ("dp_replicate", "dp_shard") or any of MESH_DIMS."""
    key = ",".join(names)
    flat = _FLAT.get(id(mesh), {})
    if key in flat:
        return flat[key]
    return mesh[names[0]] if len(names) == 1 else mesh[names]


@dataclass(frozen=True)
class Coords:
    """This rank's position: which data it reads (dp) and which stage it runs (pp)."""

    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int


def coords(mesh: DeviceMesh) -> Coords:
    dp = axis(mesh, "dp")
    return Coords(dp.get_local_rank(), dp.size(), mesh["pp"].get_local_rank(),
                  mesh["pp"].size(), mesh["tp"].get_local_rank(), mesh["tp"].size())


# -- auto layout from the planner ------------------------------------------------------------------
@dataclass
class AutoLayout:
    layout: Layout
    micro_batch: int
    recompute: str
    why: str
    candidates: list[dict[str, Any]] = field(default_factory=list)  # top planner rows considered


def _device_spec(world_size: int, gpu: str | None, memory_gb: float | None) -> Any:
    from stalwart.plan.hardware import custom_gpu, get_gpu

    if gpu:
        return custom_gpu(get_gpu(gpu), memory_gb=memory_gb)
    # CPU ranks on one host: memory is the host's share per rank; compute a nominal 1 TFLOP/s.
    if memory_gb is None:
        try:
            import psutil

            memory_gb = psutil.virtual_memory().total / 1e9 / max(1, world_size)
        except ImportError:  # pragma: no cover - psutil is a dependency
            memory_gb = 8.0
    return custom_gpu(None, peak_flops=1e12, memory_gb=memory_gb, intra_node_gbps=10.0, inter_node_gbps=10.0,
                      gpus_per_node=world_size)


def _dp_kind(layout: Layout) -> str:
    if layout.uses_ddp:
        return "DDP"
    if layout.dp_shard > 1:
        return "FSDP2 ZeRO-3" + (" (HSDP)" if layout.dp_replicate > 1 else "")
    return "FSDP2 replicated (HSDP)" if layout.dp_replicate > 1 else "no data parallel"


def auto_layout(args: Any, world_size: int, seq_len: int, global_batch: int, *, moe: Any = None,
                micro_batch: int | None = None, gpu: str | None = None, memory_gb: float | None = None,
                precision: str | None = None, top: int = 3) -> AutoLayout:
    """The planner's fastest layout that fits and that this package can build.

    ``args`` is the ModelArgs, ``moe`` its MoEArgs (or None). ``gpu`` names a planner GPU (default:
    CPU ranks sharing this host's memory). Both ZeRO-0 (DDP/replicated) and ZeRO-3 (FSDP2)
    variants are searched; the planner's ranking (step time, then memory) decides.
    """
    from dataclasses import replace

    from stalwart.plan.compute import flops_per_token
    from stalwart.plan.hardware import GB, Cluster
    from stalwart.plan.layout import search
    from stalwart.plan.memory import MemoryOptions, get_precision
    from stalwart.plan.shape import ModelShape

    shape = ModelShape.from_args(args, name="model")
    if moe is not None:
        shape = replace(shape, num_experts=moe.num_experts, top_k=moe.top_k,
                        expert_hidden=moe.expert_hidden or 0, moe_every=moe.moe_every)
    cluster = Cluster(_device_spec(world_size, gpu, memory_gb), world_size)
    prec = precision or ("bf16" if gpu else "fp32")
    mem = MemoryOptions(precision=get_precision(prec))
    fpt = flops_per_token(shape.active_params(), shape.n_layers, shape.dim, seq_len)
    fixed: dict[str, int] = {"cp": 1}
    if micro_batch:
        fixed["micro_batch"] = micro_batch
    rows: list[tuple[Any, int]] = []
    rejected: dict[str, int] = {}
    for zero in (0, 3):
        found = search(shape, cluster, seq_len, global_batch, fpt, zero=zero, fixed=fixed, mem=mem)
        for reason, n in found.rejected.items():
            rejected[reason] = rejected.get(reason, 0) + n
        rows += [(c, zero) for c in found.layouts]
    rows.sort(key=lambda r: (r[0].step.total, r[0].memory.total))
    buildable: list[tuple[Any, int, Layout]] = []
    for cand, zero in rows:
        lo = cand.layout
        if lo.dp % lo.ep:
            continue
        try:
            layout = (Layout(dp_replicate=lo.dp, tp=lo.tp, pp=lo.pp) if zero == 0 and lo.ep == 1
                      else Layout(dp_shard=lo.dp, tp=lo.tp, pp=lo.pp, ep=lo.ep))
            layout.check_model(args, moe)
        except ValueError as err:
            reason = str(err).split(";")[0].split(" (")[0]
            reason = f"not buildable here: {reason if len(reason) <= 70 else reason[:69] + '…'}"
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        if any(b[2] == layout for b in buildable):
            continue
        buildable.append((cand, zero, layout))
    if not buildable:
        reasons = ", ".join(f"{k} ({v})" for k, v in sorted(rejected.items(), key=lambda kv: -kv[1])[:4])
        raise ValueError(f"parallel = 'auto' found no layout of {world_size} ranks that fits and can be "
                         f"built for this model and batch {global_batch}: {reasons or 'none evaluated'}; "
                         f"give parallel = {{dp=.., tp=.., pp=..}} explicitly")
    best, _, layout = buildable[0]
    usable = cluster.gpu.memory_bytes * (1 - mem.headroom)
    lines = [f"parallel = 'auto' chose {layout.describe()} "
             f"({_dp_kind(layout)}), micro_batch {best.layout.micro_batch}, "
             f"recompute {best.layout.recompute}",
             f"  why: fastest of {len(buildable)} buildable layouts by the planner's step-time model: "
             f"{best.step.total * 1e3:.3g} ms/step, {best.memory.total / GB:.3g} GB per rank of "
             f"{usable / GB:.3g} GB usable"]
    for cand, _, other in buildable[1:top]:
        lines.append(f"  runner-up {other.describe()}: {cand.step.total / best.step.total:.2f}× the step time, "
                     f"{cand.memory.total / GB:.3g} GB")
    if rejected:
        lines.append("  rejected: " + ", ".join(f"{k} ({v})" for k, v in
                                                sorted(rejected.items(), key=lambda kv: -kv[1])[:4]))
    return AutoLayout(layout, best.layout.micro_batch, best.layout.recompute, "\n".join(lines),
                      [dict(c.as_dict(), zero=z) for c, z, _ in buildable[:top]])

