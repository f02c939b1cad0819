"""One entry point that composes the parallelisms, in torchtitan's order:

    pipeline split → tensor (+sequence) parallel → expert parallel → activation recompute
    → data parallel (FSDP2 / HSDP, or DDP with optional gradient compression)

and the step-level helpers whose behaviour depends on the layout (micro-batching, loss parallel,
pipeline schedule, gradient norm over mixed DTensor meshes, loss averaged over data parallel).

    mesh = build_mesh(layout)
    pm = parallelize(model, layout, mesh, ParallelOptions(micro_batch=4))
    optimizer = build_optimizer(pm.module, train_cfg)            # pm.module: original parameter names
    ids = sampler.next_batch(pm.dp_rank, pm.dp_size)             # data follows the dp axis only
    loss = pm.forward_backward(*dataset.batch(ids))              # mean loss, same on every rank
    grad_norm = pm.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()

The model may be built on the meta device (``with torch.device("meta")``): ``parallelize`` then
applies every parallelism on meta and materialises only this rank's shards, each parameter
initialised from ``init_seed`` and its name (:mod:`stalwart.train.parallel.materialize`).
The Trainer runs its own step from the pieces here (``micro_batch``, ``pipeline``, ``mean_over_dp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart import _compat
from stalwart.models.moe import moe_modules, set_aux_grad_scale
from stalwart.plan.parallel import Layout
from stalwart.train.parallel import compress as compress_mod
from stalwart.train.parallel import overlap
from stalwart.train.parallel.expert import apply_expert_parallel, expert_fsdp_divide_factor, expert_modules
from stalwart.train.parallel.materialize import is_meta, materialize
from stalwart.train.parallel.mesh import Coords, Mesh, axis, coords
from stalwart.train.parallel.pipeline import SCHEDULES, PipelineRunner, lm_loss, split_model
from stalwart.train.parallel.pp_boundary import send_full_activations
from stalwart.train.parallel.recompute import MODES as RECOMPUTE_MODES
from stalwart.train.parallel.recompute import apply_recompute
from stalwart.train.parallel.tensor import apply_tensor_parallel, loss_context


@dataclass(frozen=True)
class ParallelOptions:
    micro_batch: int = 1  # sequences per forward/backward (one pipeline micro-batch under PP)
    schedule: str = "1f1b"  # 1f1b | interleaved_1f1b | gpipe (PP only)
    virtual_stages: int = 1  # stages per PP rank; > 1 needs interleaved_1f1b
    layer_split: str | tuple[int, ...] = "even"  # even | lighter_ends | explicit counts per stage
    recompute: str = "none"  # none | selective | full
    recompute_every: int = 1  # full recompute on every k-th block only
    loss_parallel: bool = True  # TP: cross-entropy on vocabulary-sharded logits (not with PP)
    reshard_after_forward: bool = True  # FSDP2: True ≈ ZeRO-3, False ≈ ZeRO-2
    compress: str = "none"  # none | bf16 | fp16 | powersgd | alq (DDP); bf16/fp16 = reduce dtype under FSDP2
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    alq_bits: int = 4  # alq: bits per value (sign + level index): 2 | 4 | 8
    alq_update_every: int = 50  # alq: steps between level refits
    cpu_offload: bool = False  # FSDP2: sharded parameters, gradients and optimizer state live on the host
    fsdp_prefetch: int = 1  # FSDP2: blocks whose all-gathers each block issues ahead (0 = implicit only)
    ddp_bucket_mb: float = 25.0  # DDP: gradient bucket size; buckets all-reduce during the backward
    async_tp: bool = False  # TP: inductor's micro-pipelined collectives (CUDA + compiled blocks only)
    pp_scatter_gather: bool = True  # PP×TP: send the 1/tp sequence slice (False: the whole activation)

    def check(self, layout: Layout) -> None:
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be ≥ 1, got {self.micro_batch}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be ≥ 1, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b'")
        if self.schedule == "interleaved_1f1b" and layout.pp > 1 and self.virtual_stages < 2:
            raise ValueError(
                "schedule='interleaved_1f1b' needs virtual_stages ≥ 2 (stages per rank); "
                "use '1f1b' for one stage per rank"
            )
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
        compress_mod.check_mode(self.compress, layout.uses_ddp)
        if self.cpu_offload and (layout.uses_ddp or layout.dp == 1):
            raise ValueError(
                f"parallel.cpu_offload offloads FSDP2's sharded state, but layout {layout.describe()} has no "
                "FSDP2 shards to offload; set parallel.dp_mode='fsdp' with more than one data-parallel rank "
                "(or parallel.cpu_offload=false)"
            )
        overlap.check_fsdp_prefetch(self.fsdp_prefetch)
        overlap.check_ddp_bucket_mb(self.ddp_bucket_mb)
        overlap.check_async_tp(self.async_tp, layout.tp)
        if self.compress != "none" and layout.dp == 1:
            raise ValueError(f"compress={self.compress!r} compresses data-parallel gradients but dp = 1")


class ParallelModel:
    """The parallelised model on this rank plus the step logic its layout needs."""

    def __init__(
        self,
        module: nn.Module,
        parts: list[nn.Module],
        layout: Layout,
        mesh: Mesh,
        options: ParallelOptions,
        device: torch.device,
        loss_parallel: bool,
        pipeline: PipelineRunner | None,
        hook_state: Any = None,
    ) -> None:
        self.module = module  # optimizer + checkpoint view (original FQNs; DDP wrapper under DDP)
        self.parts = parts  # what runs forward on this rank (one unless PP)
        self.layout, self.mesh, self.options, self.device = layout, mesh, options, device
        self.loss_parallel = loss_parallel
        self.pipeline = pipeline
        self.hook_state = hook_state
        self.coords: Coords = coords(mesh)
        self._params: list[nn.Parameter] | None = None  # see ``clip_grad_norm_``

    # -- where this rank is ---------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def dp_size(self) -> int:
        return self.coords.dp_size

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def train(self, mode: bool = True) -> None:
        for p in self.parts:
            p.train(mode)

    # -- one step ---------------------------------------------------------------------------------
    def micro_batches(self, local_batch: int) -> int:
        mb = self.options.micro_batch
        if local_batch % mb:
            raise ValueError(f"the batch per data-parallel rank ({local_batch}) is not divisible by micro_batch={mb}")
        return local_batch // mb

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip gradient reduction on all but the last micro-batch (non-PP layouts)."""
        model = self.parts[0]
        if isinstance(model, DDP) and not enabled:
            with model.no_sync():
                yield
            return
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)
        yield

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced only after the
        ``last`` one; cross-entropy runs on vocabulary-sharded logits under TP loss parallel."""
        with self.gradient_sync(last), loss_context(self.loss_parallel):
            yield

    def begin_step(self, n_microbatches: int) -> None:
        """Weight of the MoE load-balancing loss per forward: 1/n, as the micro-batch losses (the
        pipeline schedule divides gradients by n itself)."""
        set_aux_grad_scale(self.module, 1.0 if self.pipeline is not None else 1.0 / n_microbatches)

    @staticmethod
    def local_value(loss: torch.Tensor) -> torch.Tensor:
        """A detached micro-batch loss as a plain tensor (it is a replicated DTensor under TP)."""
        value = loss.detach()
        return value.full_tensor() if isinstance(value, DTensor) else value

    def mean_over_dp(self, loss: torch.Tensor) -> torch.Tensor:
        """This dp rank's mean loss → the global batch's mean, the same on every rank (one all-reduce
        over the data-parallel ranks, asynchronous to the host)."""
        total, work = self.sum_over_dp_async(loss)
        if work is not None:
            work.wait()
        return total.div_(self.dp_size) if work is not None else total

    def sum_over_dp_async(self, loss: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the sum of ``loss`` over the data-parallel ranks: (the tensor it lands in, the work to
        wait for, None when there is nothing to reduce). The Trainer waits only where a value is used,
        so the all-reduce overlaps clipping and the update."""
        if self.dp_size == 1:
            return loss, None
        total = loss.clone()
        return total, dist.all_reduce(total, group=axis(self.mesh, "dp").get_group(), async_op=True)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The plain step for scripts and tests without a Trainer (no hooks, timers or autocast; the
        Trainer composes the same pieces with them): forward and backward over this dp rank's share of
        the global batch, gradients the mean over the global batch. Returns the global mean loss."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        n = self.micro_batches(inputs.shape[0])
        self.begin_step(n)
        if self.pipeline is not None:
            return self.mean_over_dp(self.pipeline.step(inputs, targets, n))
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        mb = self.options.micro_batch
        for i, (x, y) in enumerate(zip(inputs.split(mb), targets.split(mb))):
            with self.micro_batch(last=i == n - 1):
                loss = lm_loss(self.parts[0](x), y) / n
                loss.backward()
            total += self.local_value(loss)
        return self.mean_over_dp(total)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group (ranks holding different parts of the model), None without PP."""
        return self.mesh["pp"].get_group() if self.layout.pp > 1 else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all ranks and stages (clipped when max_norm > 0). The parameter list
        is taken once, at the first call: the optimizer holds these objects, so they stay, and a walk of
        the modules every step is Python work that grows with the model (46 µs for the debug model's
        53 modules)."""
        if self._params is None:
            self._params = list(self.module.parameters())
        return clip_grad_norm_(self._params, max_norm, self.pp_group)

    @property
    def has_moe(self) -> bool:
        """Whether the model is a mixture of experts (its load-balancing loss is worth logging)."""
        inner = self.module.module if isinstance(self.module, DDP) else self.module
        return getattr(inner, "moe_args", None) is not None

    def aux_loss(self) -> torch.Tensor:
        """Mean MoE load-balancing loss of the last micro-batch on this rank, a 0-dim fp32 device tensor
        (0 for dense models); read it on the host only when it is logged."""
        values = [m.last_aux_loss.float() for m in moe_modules(self.module) if m.last_aux_loss is not None]
        if not values:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack(values).mean()


# -- gradient norm over mixed meshes ----------------------------------------------------------------
def clip_grad_norm_(
    params: Sequence[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` but for a mix of plain tensors and DTensors on
    different meshes (TP, FSDP, EP) and for parameters split across pipeline stages. Squared norms
    of local shards are summed over the mesh axes each gradient is sharded on (never over axes it
    is replicated on), then over pipeline stages."""
    grads = [p.grad for p in params if p.grad is not None]
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if pp_group is None and (not meshes or (len(meshes) == 1 and all(isinstance(g, DTensor) for g in grads))):
        # One kind of gradient (plain: DDP; one mesh: FSDP2, TP, FSDP2×TP): torch's own clip, which
        # DTensor supports and which keeps DDP/FSDP2 runs bitwise what they were before TP/PP/EP.
        with_grad = [p for p in params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm if max_norm > 0 else float("inf"), foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    by_mesh: dict[Any, list[DTensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault(g.device_mesh, []).append(g)
    if plain:
        sq += torch.nn.utils.get_total_norm(plain, 2.0, foreach=True).float() ** 2
    for mesh, group in by_mesh.items():
        by_dims: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for g in group:
            if any(p.is_partial() for p in g.placements):  # not expected after backward; be exact
                g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
            dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())  # Shard, _StridedShard
            by_dims.setdefault(dims, []).append(g.to_local())
        for dims, local in by_dims.items():
            part = torch.nn.utils.get_total_norm(local, 2.0, foreach=True).float() ** 2
            for d in dims:
                dist.all_reduce(part, group=mesh.get_group(d))
            sq += part
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if plain:
            torch._foreach_mul_(plain, coef.to(plain[0].dtype))
        for mesh, group in by_mesh.items():
            local = DTensor.from_local(coef.to(group[0].dtype), mesh, [Replicate()] * mesh.ndim)
            torch._foreach_mul_(group, local)
    return total


# -- composition ------------------------------------------------------------------------------------
def _dp_mesh(mesh: Mesh, layout: Layout) -> DeviceMesh:
    return axis(mesh, "dp_replicate", "dp_shard") if layout.dp_replicate > 1 else axis(mesh, "dp_shard")


def _expert_dp_mesh(mesh: Mesh, layout: Layout) -> DeviceMesh:
    return mesh["dp_replicate", "dp_shard_mod_ep"] if layout.dp_replicate > 1 else mesh["dp_shard_mod_ep"]


def _apply_fsdp(part: nn.Module, mesh: Mesh, layout: Layout, options: ParallelOptions) -> None:
    dtype = compress_mod.fsdp_reduce_dtype(options.compress)
    mp = MixedPrecisionPolicy(reduce_dtype=dtype) if dtype is not None else MixedPrecisionPolicy()
    dp_mesh = _dp_mesh(mesh, layout)
    kwargs: dict[str, Any] = dict(reshard_after_forward=options.reshard_after_forward, mp_policy=mp)
    if options.cpu_offload:  # pinned host memory only where there is a device to copy to
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in part.layers.values():
        if layout.ep > 1:
            for experts in expert_modules(block):
                fully_shard(experts, mesh=_expert_dp_mesh(mesh, layout), **kwargs)
                experts.set_gradient_divide_factor(expert_fsdp_divide_factor(layout.dp_replicate, layout.dp_shard))
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(part, mesh=dp_mesh, **kwargs)


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: Mesh,
    options: ParallelOptions = ParallelOptions(),
    device: torch.device | None = None,
    init_seed: int | None = None,
) -> ParallelModel:
    """Parallelise a ``Transformer``/``MoETransformer`` in place for ``layout`` over ``mesh`` (from
    ``build_mesh``): either initialised (same weights on every rank), or on the meta device, which
    is then materialised shard by shard and initialised from ``init_seed`` (required then)."""
    moe = getattr(model, "moe_args", None)
    layout.check_model(model.args, moe, options.virtual_stages if layout.pp > 1 else 1)
    options.check(layout)
    meta = is_meta(model)
    if meta and (device is None or init_seed is None):
        raise ValueError("a model on the meta device needs parallelize(..., device=..., init_seed=...)")
    device = device or next(model.parameters()).device
    if not meta:
        model = model.to(device)
    c = coords(mesh)
    pipeline = None
    if layout.pp > 1:
        ids, parts = split_model(model, c.pp_rank, layout.pp, options.virtual_stages, options.layer_split)
        parts_m: list[nn.Module] = list(parts)
    else:
        ids, parts_m = [0], [model]
    use_lp = False
    if layout.tp > 1:
        for part in parts_m:
            use_lp = apply_tensor_parallel(part, mesh["tp"], options.loss_parallel and layout.pp == 1) or use_lp
        if options.async_tp:
            overlap.enable_async_tp(mesh["tp"], device)
        if layout.pp > 1 and not options.pp_scatter_gather:
            n_stages = layout.pp * options.virtual_stages
            for part, i in zip(parts_m, ids):
                send_full_activations(part, mesh["tp"], first=i == 0, last=i == n_stages - 1)
    if layout.ep > 1:
        for part in parts_m:
            apply_expert_parallel(part, mesh["ep"])
    for part in parts_m:
        apply_recompute(part.layers, options.recompute, options.recompute_every)
    hook_state = None
    fsdp = layout.dp > 1 and not layout.uses_ddp
    if meta and not fsdp:  # DDP needs real tensors; TP/EP alone already sharded on meta
        materialize(model, parts_m, device, init_seed)
    if layout.uses_ddp:
        # No buffer broadcast: the model's buffers (RoPE tables) are computed alike on every rank, and a
        # broadcast in every forward would hide a slow peer's delay inside each rank's compute time.
        ddp = DDP(
            model,
            process_group=mesh["dp_replicate"].get_group(),
            **_compat.ddp_without_buffer_sync(),
            bucket_cap_mb=options.ddp_bucket_mb,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        hook_state = compress_mod.register(
            ddp,
            options.compress,
            powersgd_rank=options.powersgd_rank,
            powersgd_start_iter=options.powersgd_start_iter,
            alq_bits=options.alq_bits,
            alq_update_every=options.alq_update_every,
        )
        parts_m, module = [ddp], ddp
    else:
        if fsdp:
            for part in parts_m:
                _apply_fsdp(part, mesh, layout, options)
                overlap.prefetch_fsdp(part, options.fsdp_prefetch, device)
            if meta:  # FSDP2 sharded the meta parameters: allocate and initialise this rank's shards only
                host = torch.device("cpu") if options.cpu_offload else device  # offload: shards on the host
                materialize(model, parts_m, host, init_seed, buffer_device=device)
        module = model
    if layout.pp > 1:
        pipeline = PipelineRunner(
            parts_m, ids, layout.pp * options.virtual_stages, mesh["pp"], device, options.schedule
        )
    return ParallelModel(module, parts_m, layout, mesh, options, device, use_lp, pipeline, hook_state)
