"""One call that answers the planning questions together (the Python face of `stalwart plan`):
how many days, does it fit, which layout, how often it fails, how often to checkpoint, what goodput.

    from stalwart.plan import PlanInputs, plan
    summary = plan(PlanInputs(model="gpt3-175b", gpu="h100", gpus=8192, tokens=10e12, mfu=0.5))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from stalwart.plan import compute
from stalwart.plan.hardware import Cluster, GPUSpec, custom_gpu, get_gpu
from stalwart.plan.layout import StepModel, search
from stalwart.plan.memory import ActivationOptions, MemoryOptions, Precision, get_precision
from stalwart.plan.sections import bubble_section, finite, layout_section, memory_section, reliability_section
from stalwart.plan.shape import ModelShape, shape_for

DEFAULT_MFU = 0.4  # used only when neither --mfu nor a feasible layout gives one
DEFAULT_BATCH_TOKENS = 2**22  # 4M tokens per step, doubled until every GPU gets a sequence


@dataclass
class PlanInputs:
    """Every input of the planner, with its unit. ``None`` means "derive it" (see ``plan``)."""

    # model: a registry name, or a raw parameter count, optionally reshaped
    model: str | None = None
    params: float | None = None  # parameters (count)
    layers: int | None = None
    dim: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    experts: int = 0  # MoE: experts per MoE layer (0 = dense)
    experts_per_token: int = 2  # MoE top-k
    expert_ffn: int = 0  # MoE expert hidden size (0 = ffn_hidden)
    moe_every: int = 1  # every k-th layer is MoE
    parallel_block: bool = False  # attention and MLP from one norm: half the TP traffic per layer
    attn_window: int = 0  # sliding-window attention (keys per query; 0 = full causal)
    embed_norm: bool = False  # LayerNorm after the embedding
    # data
    tokens: float | None = None  # training tokens (default: 20 per parameter)
    seq_len: int | None = None  # tokens per sequence (default: the model's)
    global_batch: int | None = None  # sequences per optimizer step
    # hardware
    gpu: str | None = None
    gpu_flops: float | None = None  # dense bf16 FLOP/s per GPU
    gpu_memory_gb: float | None = None  # decimal GB per GPU
    gpus: int | None = None
    gpus_per_node: int | None = None
    intra_node_gbps: float | None = None  # GB/s per GPU inside a node
    inter_node_gbps: float | None = None  # GB/s per GPU across nodes
    # time
    days: float | None = None  # deadline: solve for GPUs (no --gpus) or tokens (no --tokens)
    mfu: float | None = None  # model FLOPs utilisation for the day count (default: best layout's)
    attention_flops: bool = False  # add 12·L·h·s per token
    # memory
    precision: str = "bf16"
    weight_bytes: float | None = None
    grad_bytes: float | None = None
    master_bytes: float | None = None
    optimizer_bytes: float | None = None
    activation_bytes: float | None = None
    zero: int = 1
    recompute: str = "auto"
    sequence_parallel: bool = True
    flash_attention: bool = True
    dropout: bool = False
    headroom: float = 0.10
    cpu_offload: bool = False  # ZeRO-sharded state (optimizer, ...) in host memory
    # layout
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    micro_batch: int | None = None
    virtual_stages: int = 1
    top: int = 10
    compute_efficiency: float = StepModel.compute_efficiency
    overlap: bool = True  # DP gradient reduce and ZeRO-3 gathers hidden under compute (DDP buckets, FSDP2 prefetch)
    # reliability
    gpu_fail_per_day: float = 0.001  # probability one GPU fails on a given day
    node_mtbf_hours: float = 0.0  # extra per-node failures (0 = none)
    ckpt_write_gbps: float = 100.0  # aggregate storage write bandwidth, GB/s
    ckpt_stall_s: float | None = None  # override the storage checkpoint stall
    restart_s: float = 600.0  # detect + reschedule + restart + load from storage
    disk_interval_hours: float = 3.0  # the fixed-interval storage policy to compare
    snapshot_every: int = 10  # steps between in-memory snapshots
    snapshot_restart_s: float = 120.0  # restart from a memory snapshot
    snapshot_recoverable: float = 0.9  # share of failures a memory snapshot survives
    host_copy_gbps: float = 20.0  # GPU→host copy per GPU, GB/s
    notes: list[str] = field(default_factory=list)


# -- inputs → objects ----------------------------------------------------------------------------
def build_shape(inp: PlanInputs) -> tuple[ModelShape, float, list[str]]:
    """The model shape, the parameter count used for compute, and notes on assumptions."""
    notes: list[str] = []
    moe = dict(
        num_experts=inp.experts,
        top_k=inp.experts_per_token if inp.experts else 1,
        expert_hidden=inp.expert_ffn,
        moe_every=inp.moe_every,
    )
    if inp.model and inp.params:
        raise ValueError("give either --model NAME or --params N, not both")
    if inp.model:
        shape = replace(shape_for(inp.model), **moe)
    elif inp.layers and inp.dim:
        heads = inp.heads or max(1, inp.dim // 128)
        shape = ModelShape(
            name="custom",
            dim=inp.dim,
            n_layers=inp.layers,
            n_heads=heads,
            kv_heads=inp.kv_heads or heads,
            ffn_hidden=inp.ffn_hidden or 4 * inp.dim,
            vocab_size=inp.vocab or 50257,
            mlp="gelu",
            norm="layernorm",
            bias=True,
            tie_embeddings=True,
            **moe,
        )
        if inp.params:
            raise ValueError("give either --params or the shape (--layers, --dim, ...), not both")
    elif inp.params:
        shape = _gpt_like(inp.params, inp.vocab or 50257, moe)
        notes.append(
            f"shape assumed GPT-3-like for {inp.params:.3g} params: {shape.n_layers} layers, "
            f"dim {shape.dim}, {shape.n_heads} heads (d ≈ 128·L); give --layers/--dim to set it"
        )
    else:
        raise ValueError(
            "give a model: --model NAME (see `stalwart plan gpus` for hardware, "
            "stalwart.models.SPECS for models) or --params N"
        )
    overrides = {
        k: v
        for k, v in (
            ("n_layers", inp.layers),
            ("dim", inp.dim),
            ("n_heads", inp.heads),
            ("kv_heads", inp.kv_heads),
            ("ffn_hidden", inp.ffn_hidden),
            ("vocab_size", inp.vocab),
        )
        if v
    }
    if inp.attn_window < 0:
        raise ValueError(f"--attn-window must be >= 0 (0 = full causal attention), got {inp.attn_window}")
    techniques = dict(parallel_block=inp.parallel_block, attn_window=inp.attn_window, embed_norm=inp.embed_norm)
    shape = replace(shape, **(overrides if inp.model else {}), **techniques)
    n_params = inp.params or float(shape.active_params())
    return shape, n_params, notes


def _gpt_like(n_params: float, vocab: int, moe: dict[str, int]) -> ModelShape:
    """GPT-3's aspect ratio (12·L·d² ≈ N with d ≈ 128·L, head dim 128), rounded so that tensor
    parallelism has divisors: layers and heads to multiples of 8 once they exceed 16."""

    def round8(x: float) -> int:
        return max(1, round(x)) if x < 16 else 8 * round(x / 8)

    layers = round8((n_params / (12 * 128**2)) ** (1 / 3))
    heads = round8(math.sqrt(n_params / (12 * layers)) / 128)
    dim = 128 * heads
    return ModelShape(
        name="gpt-like",
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        kv_heads=heads,
        ffn_hidden=4 * dim,
        vocab_size=vocab,
        mlp="gelu",
        norm="layernorm",
        bias=True,
        tie_embeddings=True,
        **moe,
    )


def build_gpu(inp: PlanInputs) -> GPUSpec:
    base = get_gpu(inp.gpu) if inp.gpu else None  # no name and no --gpu-memory: no memory limit
    return custom_gpu(
        base,
        peak_flops=inp.gpu_flops,
        memory_gb=inp.gpu_memory_gb,
        intra_node_gbps=inp.intra_node_gbps,
        inter_node_gbps=inp.inter_node_gbps,
        gpus_per_node=inp.gpus_per_node,
    )


def build_memory_options(inp: PlanInputs) -> MemoryOptions:
    prec = get_precision(inp.precision)
    changes = {
        k: v
        for k, v in (
            ("weight_bytes", inp.weight_bytes),
            ("grad_bytes", inp.grad_bytes),
            ("master_bytes", inp.master_bytes),
            ("optimizer_bytes", inp.optimizer_bytes),
            ("activation_bytes", inp.activation_bytes),
        )
        if v is not None
    }
    prec = Precision(**{**prec.__dict__, **changes})
    act = ActivationOptions(
        sequence_parallel=inp.sequence_parallel, flash_attention=inp.flash_attention, dropout=inp.dropout
    )
    return MemoryOptions(precision=prec, activations=act, headroom=inp.headroom, cpu_offload=inp.cpu_offload)


def default_global_batch(seq_len: int, n_gpus: int) -> int:
    batch = max(1, DEFAULT_BATCH_TOKENS // seq_len)
    while batch < n_gpus:
        batch *= 2
    return batch


def _check_reliability_inputs(inp: PlanInputs) -> None:
    if not 0 <= inp.gpu_fail_per_day < 1:
        raise ValueError(f"--gpu-fail-per-day is a probability in [0, 1), got {inp.gpu_fail_per_day}")
    if not 0 <= inp.snapshot_recoverable <= 1:
        raise ValueError(f"--snapshot-recoverable is a fraction in [0, 1], got {inp.snapshot_recoverable}")
    for flag, value in (
        ("--ckpt-write-gbps", inp.ckpt_write_gbps),
        ("--host-copy-gbps", inp.host_copy_gbps),
        ("--disk-interval-hours", inp.disk_interval_hours),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in (
        ("--restart-s", inp.restart_s),
        ("--snapshot-restart-s", inp.snapshot_restart_s),
        ("--snapshot-every", inp.snapshot_every),
        ("--node-mtbf-hours", inp.node_mtbf_hours),
        ("--ckpt-stall-s", inp.ckpt_stall_s or 0),
    ):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")


# -- the plan ------------------------------------------------------------------------------------
def plan(inp: PlanInputs) -> dict[str, Any]:
    """All estimates as one JSON-ready dict (see docs/plan.md for every field and formula)."""
    if inp.mfu is not None and not 0 < inp.mfu <= 1:
        raise ValueError(f"--mfu (model FLOPs utilisation, MFU) must be in (0, 1], got {inp.mfu}")
    if inp.gpus is not None and inp.gpus <= 0:
        raise ValueError(f"--gpus must be a positive number of GPUs, got {inp.gpus}")
    if inp.top < 1:
        raise ValueError(f"--top must be >= 1, got {inp.top}")
    _check_reliability_inputs(inp)
    shape, n_params, notes = build_shape(inp)
    notes = [*inp.notes, *notes]
    gpu = build_gpu(inp)
    mem_opts = build_memory_options(inp)
    seq_len = inp.seq_len or shape.max_seq_len
    if seq_len <= 0:
        raise ValueError(f"--seq-len must be positive, got {seq_len}")
    fpt = compute.flops_per_token(
        n_params, shape.n_layers, shape.dim, seq_len, attention=inp.attention_flops, window=shape.attn_window
    )

    # Which quantity is solved for: GPUs, tokens, or days.
    solved = "days"
    tokens = inp.tokens
    if inp.days is not None:
        if inp.gpus is not None and inp.tokens is not None:
            raise ValueError("give at most two of --gpus, --tokens and --days (the third is solved for)")
        if inp.gpus is None:
            solved = "gpus"
            tokens = tokens or compute.chinchilla_tokens(n_params)
            mfu_solve = inp.mfu or DEFAULT_MFU
            if inp.mfu is None:
                notes.append(f"GPU count solved at MFU {DEFAULT_MFU} (give --mfu to change)")
            n_gpus = compute.gpus_for_days(
                compute.total_flops(tokens, fpt), inp.days, gpu.peak_flops, mfu_solve, multiple=gpu.gpus_per_node
            )
        else:
            solved = "tokens"
            n_gpus = inp.gpus
    else:
        if inp.gpus is None:
            raise ValueError("give --gpus N (or --days D to solve for the GPU count)")
        n_gpus = inp.gpus
        if tokens is None:
            tokens = compute.chinchilla_tokens(n_params)
            notes.append("tokens defaulted to 20 per parameter (Chinchilla); give --tokens")
    cluster = Cluster(gpu, n_gpus)
    global_batch = inp.global_batch or default_global_batch(seq_len, n_gpus)

    # Layouts (also the source of MFU when none is given).
    fixed = {k: getattr(inp, k) for k in ("dp", "tp", "pp", "cp", "ep", "micro_batch") if getattr(inp, k)}
    step_model = StepModel(compute_efficiency=inp.compute_efficiency, overlap_dp=inp.overlap, overlap_zero3=inp.overlap)
    found = search(
        shape,
        cluster,
        seq_len,
        global_batch,
        fpt,
        zero=inp.zero,
        recompute=inp.recompute,
        virtual_stages=inp.virtual_stages,
        fixed=fixed,
        mem=mem_opts,
        model=step_model,
    )
    best = found.layouts[0] if found.layouts else None
    if inp.mfu is not None:
        mfu, mfu_source = inp.mfu, "given"
    elif best is not None:
        mfu, mfu_source = best.step.mfu, "best layout (step-time model)"
    else:
        mfu, mfu_source = DEFAULT_MFU, "default (no feasible layout)"
    if solved == "tokens":
        tokens = compute.tokens_for_days(inp.days, n_gpus, gpu.peak_flops, mfu, fpt)
    assert tokens is not None
    flops = compute.total_flops(tokens, fpt)
    days = compute.training_days(flops, n_gpus, gpu.peak_flops, mfu)

    out: dict[str, Any] = {
        "model": shape.name,
        "n_params": n_params,
        "total_params": shape.total_params(),
        "gpu": gpu.name,
        "gpus": n_gpus,
        "nodes": cluster.n_nodes,
        "gpu_peak_flops": gpu.peak_flops,
        "tokens": tokens,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "solved_for": solved,
        "flops_per_token": fpt,
        "total_flops": flops,
        "mfu": mfu,
        "mfu_source": mfu_source,
        "days": days,
        "gpu_hours": days * 24 * n_gpus,
    }
    out.update(memory_section(shape, n_params, cluster, mem_opts, found, notes))
    out.update(layout_section(found, inp.top))
    out["pipeline_bubble"] = bubble_section(shape, found, cluster, seq_len, global_batch, fpt, mem_opts, step_model)
    out.update(reliability_section(inp, cluster, n_params, mem_opts, best, days))
    if not math.isfinite(gpu.memory_bytes):
        notes.append("GPU memory unknown (no --gpu and no --gpu-memory): layouts were not checked against memory")
    out["notes"] = notes
    return finite(out)
