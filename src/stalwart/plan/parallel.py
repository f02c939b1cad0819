"""The parallel layout — one type for the planner and the trainer — and the pipeline partition.

A :class:`Layout` names the degree of every axis: ``dp_replicate`` (DDP / HSDP replicas),
``dp_shard`` (FSDP2 / ZeRO shards), ``tp`` (tensor + sequence parallel), ``pp`` (pipeline stages),
``ep`` (expert parallel, carved out of ``dp_shard`` as in torchtitan) and ``cp`` (context parallel:
the planner models it; the trainer cannot build it yet, see :data:`CP_UNSUPPORTED`). The world is
``pp × dp_replicate × dp_shard × cp × tp`` ranks, slowest to fastest varying (Megatron-LM's order:
TP groups are the closest ranks, PP groups the farthest), which decides which groups stay in a node.

A :class:`Strategy` is a Layout plus how each step runs on it (micro-batch, interleaved stages,
ZeRO stage, recompute): what the memory estimator and the layout search evaluate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from stalwart.plan.shape import ModelShape

RECOMPUTE = ("none", "selective", "full")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")  # Layout.shape's order
SHARED_GPU_DTENSOR = (
    "parallel layout {layout} with ranks sharing a GPU over gloo is refused: torch's functional "
    "collectives (the all-gathers of FSDP2/TP/EP DTensors) crash with SIGSEGV over gloo on CUDA tensors "
    "(torch 2.11 on an H100, under plain torchrun too). Give every rank its own GPU (NCCL: no more ranks "
    "per node than GPUs), train on the CPU with parallel.backend='gloo', or share the GPU with DDP "
    "(parallel.dp_mode='ddp')"
)
CP_UNSUPPORTED = (
    "context parallel (cp > 1) is not supported: torch 2.13 has no CPU sharding strategy "
    "for scaled_dot_product_attention, and it has not been verified on a GPU here; "
    "keep cp = 1 (the mesh axis is reserved)"
)


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
        if self.dp_shard % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard}: expert "
                f"parallelism is carved out of the FSDP shard group; set dp_shard to a multiple "
                f"of {self.ep}"
            )

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
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and self.ep == 1

    @property
    def uses_dtensor(self) -> bool:
        """FSDP2, TP and EP hold parameters as DTensors, whose redistributions are torch's functional
        collectives; DDP and PP alone use plain ones."""
        return self.tp > 1 or self.ep > 1 or (self.dp > 1 and not self.uses_ddp)

    def check_device(self, backend: str, device_type: str) -> None:
        """Refuse a DTensor layout whose ranks share a GPU over gloo (SHARED_GPU_DTENSOR)."""
        if device_type == "cuda" and backend == "gloo" and self.uses_dtensor:
            raise ValueError(SHARED_GPU_DTENSOR.format(layout=self.describe()))

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
                f"but the job has {world_size}; change the degrees or the number of processes"
            )

    def check_model(self, args: Any, moe: Any = None, virtual_stages: int = 1) -> None:
        """Raise ValueError when the trainer cannot split the model this way (``args``: ModelArgs,
        ``moe``: MoEArgs or None)."""
        if self.cp > 1:
            raise ValueError(CP_UNSUPPORTED)
        if self.tp > 1:
            if args.n_heads % self.tp or args.kv_heads % self.tp:
                raise ValueError(
                    f"parallel.tp={self.tp} must divide model.n_heads={args.n_heads} and "
                    f"model.n_kv_heads={args.kv_heads} (each TP rank owns whole heads); use tp in "
                    f"{_common_divisors(args.n_heads, args.kv_heads)}"
                )
            if args.hidden % self.tp:
                raise ValueError(f"parallel.tp={self.tp} must divide the feed-forward hidden size {args.hidden}")
            if moe is not None:
                raise ValueError(
                    "tensor parallelism of MoE blocks is not implemented; use ep (expert "
                    "parallel) with dp_shard, or pp, for MoE models and keep tp = 1"
                )
            if args.pos != "rope":
                raise ValueError(
                    f"tensor parallelism supports RoPE models only (model.pos={args.pos!r}); "
                    "learned/ALiBi positions would need their own sequence-parallel plan"
                )
        if args.tie_embeddings and (self.tp > 1 or self.pp > 1):
            raise ValueError(
                "tensor and pipeline parallelism need untied embeddings (the embedding and the "
                "head are split differently / live on different stages); set "
                "model.tie_embeddings = false"
            )
        stages = self.pp * virtual_stages
        if stages > args.n_layers:
            raise ValueError(
                f"pp={self.pp} × virtual_stages={virtual_stages} = {stages} pipeline stages but the model "
                f"has only {args.n_layers} layers; every stage needs at least one layer"
            )
        if self.ep > 1:
            if moe is None:
                raise ValueError(
                    f"parallel.ep={self.ep} needs a mixture-of-experts model (e.g. "
                    f"model.name = 'debug-moe'); use ep = 1 for a dense model"
                )
            if moe.num_experts % self.ep:
                raise ValueError(f"parallel.ep={self.ep} must divide the expert count {moe.num_experts}")


def _common_divisors(a: int, b: int) -> list[int]:
    return [d for d in range(1, math.gcd(a, b) + 1) if a % d == 0 and b % d == 0]


_KEYS = {"dp", "dp_replicate", "dp_shard", "tp", "pp", "ep", "cp"}


def layout_from_config(value: dict[str, int] | Layout, world_size: int, dp_mode: str = "fsdp") -> Layout:
    """``{dp=.., tp=.., pp=.., ep=..}`` → Layout. ``dp`` means dp_shard (FSDP2) unless ``dp_mode`` is
    "ddp"; a missing dp is whatever the world leaves after tp × pp × cp. ``"auto"`` is handled by
    :func:`stalwart.plan.auto.auto_layout` instead."""
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
    if cp > 1:
        raise ValueError(CP_UNSUPPORTED)
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


@dataclass(frozen=True)
class Strategy:
    """A Layout plus how each step runs on it: what the memory estimator and the search evaluate."""

    layout: Layout = Layout()
    micro_batch: int = 1  # sequences per forward/backward on one pipeline
    virtual_stages: int = 1  # interleaved 1F1B chunks per GPU (Narayanan et al. 2021)
    zero: int = 1  # ZeRO stage over the data-parallel group (0-3)
    recompute: str = "selective"  # none | selective | full (Korthikanti et al. 2022)

    def __post_init__(self) -> None:
        for key in ("micro_batch", "virtual_stages"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    @classmethod
    def of(
        cls, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, zero: int = 1, **step: Any
    ) -> Strategy:
        """The planner's view: ``dp`` ranks of data parallelism under ZeRO stage ``zero``. ZeRO-0
        without experts is replication (DDP); any sharding of state is ``dp_shard`` (FSDP2)."""
        if ep >= 1 and dp % ep:
            raise ValueError(f"expert parallel degree {ep} must divide data parallel degree {dp}")
        degrees = dict(tp=tp, pp=pp, cp=cp, ep=ep)
        layout = Layout(dp_replicate=dp, **degrees) if zero == 0 and ep == 1 else Layout(dp_shard=dp, **degrees)
        return cls(layout, zero=zero, **step)

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def zero_group(self) -> int:
        """Ranks that shard optimizer state (Megatron's distributed optimizer uses DP×CP)."""
        return self.dp * self.cp

    def num_micro_batches(self, global_batch: int) -> int:
        per_step = self.dp * self.micro_batch
        if global_batch % per_step:
            raise ValueError(
                f"global batch {global_batch} is not divisible by dp {self.dp} × micro-batch {self.micro_batch}"
            )
        return global_batch // per_step

    def as_dict(self) -> dict[str, object]:
        return dict(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            micro_batch=self.micro_batch,
            virtual_stages=self.virtual_stages,
            zero=self.zero,
            recompute=self.recompute,
        )


def partition_layers(n_layers: int, pp: int, head_share: float = 0.0) -> list[int]:
    """Layers per pipeline stage that minimise the slowest stage when the last stage also runs the
    LM head (worth ``head_share`` layers). Earlier stages split the rest evenly."""
    if pp < 1 or pp > n_layers:
        raise ValueError(f"pipeline stages ({pp}) must be between 1 and the layer count ({n_layers})")
    if pp == 1:
        return [n_layers]
    best: tuple[float, int] | None = None
    for last in range(1, math.ceil(n_layers / pp) + 1):
        rest = n_layers - last
        if rest < pp - 1:
            break
        worst = max(math.ceil(rest / (pp - 1)), last + head_share)
        if best is None or worst < best[0]:
            best = (worst, last)
    assert best is not None
    last = best[1]
    rest, stages = n_layers - last, pp - 1
    counts = [rest // stages + (1 if i < rest % stages else 0) for i in range(stages)]
    return [*counts, last]


def moe_layers_in(shape: ModelShape, n_layers: int) -> int:
    """MoE layers among ``n_layers`` consecutive layers (proportional share, rounded up)."""
    if not shape.is_moe:
        return 0
    return min(n_layers, math.ceil(n_layers / shape.moe_every))
