"""A run's plan, resolved once per process: ``resolve(config, world_size) -> RunPlan``.

The ``[parallel]`` section becomes a checked :class:`~stalwart.plan.parallel.Layout` and
``ParallelOptions``, with the model's shape and the gradient accumulation it implies. Explicit degrees
(``parallel.dp/tp/pp/ep``, or ``dp_replicate``/``dp_shard`` for HSDP) go through
``layout_from_config``; ``parallel.layout = "auto"`` asks the planner (``stalwart.plan.auto``) for the
fastest layout that fits, with ``train.micro_batch`` pinned. Every mistake is a ``ValueError``.

Who calls it: ``stalwart train`` before it spawns workers (so mistakes fail before any process
starts), and each worker's Trainer, once; the Trainer then agrees on rank 0's plan (:func:`rank0_plan`)
and passes the RunPlan down. Nothing else plans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stalwart.plan.auto import auto_layout
from stalwart.plan.parallel import Layout, layout_from_config
from stalwart.train.parallel.apply import ParallelOptions
from stalwart.train.parallel.pipeline import check_microbatches, stage_layers

if TYPE_CHECKING:
    from stalwart.config import Config
    from stalwart.models import ModelArgs, MoEArgs


@dataclass(frozen=True)
class RunPlan:
    layout: Layout
    options: ParallelOptions
    grad_accum: int  # micro-batches per rank per optimizer step
    model_args: ModelArgs
    moe: MoEArgs | None = None
    why: str = ""  # parallel.layout = "auto": the planner's explanation

    def summary(self) -> dict[str, Any]:
        """What summary.json records about the layout."""
        o, lo = self.options, self.layout
        out: dict[str, Any] = {
            "degrees": lo.as_dict(),
            "describe": lo.describe(),
            "data_parallel": "ddp" if lo.uses_ddp else "fsdp2" if lo.dp > 1 else "none",
            "recompute": o.recompute,
        }
        if lo.pp > 1:
            out.update(schedule=o.schedule, virtual_stages=o.virtual_stages, layer_split=o.layer_split)
        if o.compress != "none":
            out["compress"] = o.compress
        overlap = {
            "ddp_bucket_mb": o.ddp_bucket_mb if lo.uses_ddp else None,
            "fsdp_prefetch": o.fsdp_prefetch if lo.dp > 1 and not lo.uses_ddp else None,
            "async_tp": o.async_tp if lo.tp > 1 else None,
            "pp_scatter_gather": o.pp_scatter_gather if lo.pp > 1 and lo.tp > 1 else None,
        }
        out["overlap"] = {k: v for k, v in overlap.items() if v is not None}  # docs/techniques.md
        if self.why:
            out["auto"] = self.why
        return out


def grad_accum(global_batch: int, micro_batch: int, dp_world: int) -> int:
    """Micro-batches per rank per step; re-derived whenever the data-parallel world changes."""
    per_step = dp_world * micro_batch
    if global_batch % per_step:
        fits = [m for m in range(1, global_batch + 1) if global_batch % (dp_world * m) == 0]
        hint = f"micro_batch in {fits}" if fits else f"a global_batch divisible by {dp_world}"
        raise ValueError(
            f"train.global_batch={global_batch} is not divisible by data-parallel ranks ({dp_world}) × "
            f"train.micro_batch ({micro_batch}) = {per_step}; use {hint}"
        )
    return global_batch // per_step


def resolve_model_args(cfg: Config, vocab_size: int | None = None) -> ModelArgs:
    """The registry shape with the config's overrides, sized to the data's vocabulary (None: the
    registry's, enough for the layout checks, which do not depend on it)."""
    from stalwart.models import model_args

    m = cfg.model
    overrides: dict[str, Any] = {"max_seq_len": cfg.data.seq_len}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
        if getattr(m, key):
            overrides[key] = getattr(m, key)
    for key in ("tie_embeddings", "parallel_block", "embed_norm", "attn_window"):
        if getattr(m, key):
            overrides[key] = getattr(m, key)
    return model_args(m.name, **overrides)


def _layer_split(text: str) -> str | tuple[int, ...]:
    if re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text):
        return tuple(int(c) for c in text.split(","))
    return text


def resolve(cfg: Config, world_size: int, vocab_size: int | None = None) -> RunPlan:
    """The checked plan for ``world_size`` ranks: the config's field checks, then degrees × world size ×
    model × batch split (or the planner's choice). ``vocab_size``: the data's (None: the registry's)."""
    from stalwart.data.sampler import parse_skip_ranges
    from stalwart.models import moe_args
    from stalwart.observe import tensorboard

    cfg.validate()
    parse_skip_ranges(cfg.data.skip_samples)
    tensorboard.wanted(cfg.train.tensorboard)  # `on` without the package: say so before any worker starts
    p, t = cfg.parallel, cfg.train
    args, moe = resolve_model_args(cfg, vocab_size), moe_args(cfg.model.name)
    recompute, why = p.recompute, ""
    if p.layout == "auto":
        explicit = {k: v for k, v in p.degrees().items() if v != 1}
        if explicit:
            raise ValueError(
                f"parallel.layout='auto' chooses the degrees itself; remove "
                f"{', '.join(f'parallel.{k}={v}' for k, v in explicit.items())} or set "
                f"parallel.layout='manual'"
            )
        choice = auto_layout(args, world_size, cfg.data.seq_len, t.global_batch, moe=moe, micro_batch=t.micro_batch)
        layout, why = choice.layout, choice.why
        recompute = p.recompute if p.recompute != "none" else choice.recompute
    else:  # "manual" (Config.validate checks the value)
        layout = layout_from_config(p.degrees(), world_size, p.dp_mode)
    options = ParallelOptions(
        micro_batch=t.micro_batch,
        schedule=p.schedule,
        virtual_stages=p.virtual_stages,
        layer_split=_layer_split(p.layer_split),
        recompute=recompute,
        recompute_every=p.recompute_every,
        loss_parallel=p.loss_parallel,
        reshard_after_forward=p.reshard_after_forward,
        compress=p.compress,
        powersgd_rank=p.powersgd_rank,
        alq_bits=p.alq_bits,
        alq_update_every=p.alq_update_every,
        cpu_offload=p.cpu_offload,
        fsdp_prefetch=p.fsdp_prefetch,
        ddp_bucket_mb=p.ddp_bucket_mb,
        async_tp=p.async_tp,
        pp_scatter_gather=p.pp_scatter_gather,
    )
    if options.async_tp and not getattr(t, "compile", False):
        raise ValueError("parallel.async_tp is an inductor pass over compiled blocks: it needs train.compile = true")
    virtual = options.virtual_stages if layout.pp > 1 else 1
    layout.check_model(args, moe, virtual)
    options.check(layout)
    accum = grad_accum(t.global_batch, t.micro_batch, layout.dp)
    if layout.pp > 1:
        stage_layers(args.n_layers, layout.pp, virtual, options.layer_split)
        check_microbatches(options.schedule, accum, layout.pp)
    return RunPlan(layout, options, accum, args, moe, why)


def rank0_plan(plan: RunPlan) -> RunPlan:
    """Rank 0's plan on every rank when it came from the planner: ``auto`` sizes memory from the
    host, and ranks on different hosts must still build one layout. A collective."""
    import torch.distributed as dist

    if not plan.why or not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    box: list[Any] = [plan]
    dist.broadcast_object_list(box, src=0)
    return box[0]
