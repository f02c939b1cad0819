"""Analytic step time of one optimizer step on the slowest pipeline stage (Narayanan et al. 2021):

    (m + (p-1)/v) × t_mb  +  exposed DP gradient sync  +  exposed ZeRO-3 gathers

where t_mb = compute + TP/SP collectives + exposed CP ring + EP all-to-all + PP send/recv for one
micro-batch, m micro-batches per step, p stages and v interleaved chunks ((p-1)/(v·m) bubble).
Compute runs at a calibrated fraction of peak that drops for thin per-GPU matrix multiplies; TP
(and CP/EP when they fit) stay inside a node on NVLink; DP crosses nodes unless the whole group fits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from stalwart.plan.compute import attended
from stalwart.plan.hardware import GB, Cluster
from stalwart.plan.parallel import Strategy, moe_layers_in, partition_layers
from stalwart.plan.shape import ModelShape


@dataclass(frozen=True)
class StepModel:
    """Knobs of the analytic step-time model (defaults calibrated on published A100 runs)."""

    compute_efficiency: float = 0.60  # fraction of peak for wide GEMM-dominated layers (see docs/plan.md)
    gemm_half_width: float = 128.0  # per-GPU GEMM width (hidden/tp, tokens/cp) at which efficiency halves
    bandwidth_efficiency: float = 0.7  # achieved / nominal bandwidth of collectives
    overlap_dp: bool = True  # gradient reduce overlaps the last micro-batch's backward
    overlap_zero3: bool = True  # ZeRO-3 gathers are prefetched under compute
    max_micro_batch: int = 16
    max_cp: int = 16
    min_cp_chunk: int = 2048  # tokens per CP rank below which ring attention cannot hide its traffic

    def __post_init__(self) -> None:
        for key in ("compute_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"{key.replace('_', '-')} must be in (0, 1], got {getattr(self, key)}")


@dataclass(frozen=True)
class StepTime:
    compute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float  # exposed part
    zero3_comm: float  # exposed part
    total: float
    tokens_per_s: float
    mfu: float  # model FLOPs (the plan's FLOPs/token) ÷ peak
    hfu: float  # including recomputation

    @property
    def exposed_comm_fraction(self) -> float:
        """Share of the step spent in communication not hidden under compute (bubble excluded)."""
        comm = self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.dp_comm + self.zero3_comm
        return comm / self.total if self.total > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def tp_reductions_per_layer(parallel_block: bool, recompute: str = "none") -> int:
    """TP all-reduce equivalents (all-gather + reduce-scatter pairs under SP) per layer and micro-batch."""
    per_pass = 1 if parallel_block else 2
    return per_pass * (3 if recompute == "full" else 2)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_time(
    shape: ModelShape,
    strategy: Strategy,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    model_flops_per_token: float,
    act_bytes: float = 2.0,
    grad_bytes: float = 2.0,
    weight_bytes: float = 2.0,
    sequence_parallel: bool = True,
    model: StepModel = StepModel(),
) -> StepTime:
    """Analytic time of one optimizer step (seconds) and the resulting throughput and MFU."""
    gpu = cluster.gpu
    gpn = cluster.gpus_per_node
    intra = gpu.intra_node_gbps * GB * model.bandwidth_efficiency
    inter = gpu.inter_node_gbps * GB * model.bandwidth_efficiency
    tp, cp, pp, ep, v, b = (
        strategy.tp,
        strategy.cp,
        strategy.pp,
        strategy.ep,
        strategy.virtual_stages,
        strategy.micro_batch,
    )
    m = strategy.num_micro_batches(global_batch)
    s_loc = seq_len / cp
    tokens_mb = b * seq_len
    h = shape.dim

    # Compute: FLOPs of the slowest stage per micro-batch (6 per active matmul parameter per token,
    # + the attention core 12·h·s per layer, PaLM), 8/6 of the forward again under full recompute.
    dense_layer = shape.attention_params() + shape.mlp_params()
    moe_layer = shape.attention_params() + shape.router_params() + shape.top_k * shape.expert_params()
    core = 12 * h * attended(seq_len, shape.attn_window)  # sliding window: min(W, s) keys per query
    counts = partition_layers(shape.n_layers, pp, shape.head_flop_share())
    head = 6 * shape.vocab_size * h
    recompute_factor = {"none": 1.0, "selective": 1.0, "full": 8 / 6}[strategy.recompute]
    stage_flops = []
    for i, n in enumerate(counts):
        n_moe = moe_layers_in(shape, n)
        per_tok = ((n - n_moe) * 6 * dense_layer + n_moe * 6 * moe_layer + n * core) * recompute_factor
        stage_flops.append(per_tok + (head if i == pp - 1 else 0.0))
    worst = max(range(pp), key=lambda i: stage_flops[i])
    n_layers_worst = counts[worst]
    width = h / tp
    eff = (
        model.compute_efficiency
        * width
        / (width + model.gemm_half_width)
        * s_loc
        * b
        / (s_loc * b + model.gemm_half_width)
    )
    compute_mb = stage_flops[worst] * tokens_mb / (tp * cp) / (gpu.peak_flops * eff)

    # TP/SP: 2 all-reduces (or all-gather + reduce-scatter pairs) forward, 2 backward per layer,
    # 2 more when the forward is recomputed; ring volume 2(t-1)/t of the activation. A parallel
    # block reduces its two branches' sum once: 1 forward, 1 backward (+1 recomputed).
    act = b * s_loc * h * act_bytes
    n_ar = tp_reductions_per_layer(shape.parallel_block, strategy.recompute)
    tp_mb = n_layers_worst * n_ar * 2 * _ring(tp) * act / intra if tp > 1 else 0.0

    # CP: ring passes K and V (cp-1) times forward, ~2x that backward; hidden under attention compute.
    cp_mb = 0.0
    if cp > 1:
        kv = 3 * (cp - 1) * 2 * b * s_loc * shape.kv_dim * act_bytes / tp
        bw = intra if tp * cp <= gpn else inter
        core_time = core * b * s_loc / tp / (gpu.peak_flops * eff)
        cp_mb = n_layers_worst * max(0.0, kv / bw - core_time)

    # EP: dispatch + combine all-to-all, forward and backward, per MoE layer.
    ep_mb = 0.0
    if shape.is_moe and ep > 1:
        routed = shape.top_k * act / (tp if sequence_parallel else 1)
        bw = intra if tp * ep <= gpn else inter
        ep_mb = moe_layers_in(shape, n_layers_worst) * 4 * _ring(ep) * routed / bw

    # PP: send activations forward and gradients backward at each chunk boundary.
    pp_mb = 0.0
    if pp > 1:
        bw = intra if tp * cp * strategy.dp < gpn else inter
        pp_mb = 2 * v * act / tp / bw

    t_mb = compute_mb + tp_mb + cp_mb + ep_mb + pp_mb
    bubble = (pp - 1) / v * t_mb

    # DP: reduce gradients (and gather updated weights under ZeRO-1/2) across dp×cp replicas.
    dense_local, expert_local = _local_params(shape, strategy, counts)
    z, z_exp = strategy.zero_group, max(1, strategy.zero_group // ep)
    group_per_node = max(1, gpn // (tp * cp))
    dp_bw = intra if z <= group_per_node else min(intra, inter * min(group_per_node, z))

    def volume(bytes_per_param: float, factor: float) -> float:
        return factor * (dense_local * _ring(z) + expert_local * _ring(z_exp)) * bytes_per_param

    dp_exposed = z3_exposed = 0.0
    bwd_window = compute_mb * (2 / 3) / recompute_factor if model.overlap_dp else 0.0
    if strategy.zero == 0:
        dp_exposed = max(0.0, volume(grad_bytes, 2) / dp_bw - bwd_window)
    elif strategy.zero in (1, 2):
        dp_exposed = max(0.0, volume(grad_bytes, 1) / dp_bw - bwd_window) + volume(weight_bytes, 1) / dp_bw
    else:  # ZeRO-3: gather weights for forward and backward, reduce-scatter grads, per micro-batch
        per_mb = (volume(weight_bytes, 2) + volume(grad_bytes, 1)) / dp_bw
        hidden = compute_mb if model.overlap_zero3 else 0.0
        z3_exposed = m * max(0.0, per_mb - hidden)

    total = (m * t_mb + bubble) + dp_exposed + z3_exposed
    tokens = global_batch * seq_len
    peak = cluster.n_gpus * gpu.peak_flops
    hw_flops = sum(stage_flops) * tokens  # per-token FLOPs summed over stages, all tokens
    return StepTime(
        compute=m * compute_mb,
        tp_comm=m * tp_mb,
        cp_comm=m * cp_mb,
        ep_comm=m * ep_mb,
        pp_comm=m * pp_mb,
        bubble=bubble,
        dp_comm=dp_exposed,
        zero3_comm=z3_exposed,
        total=total,
        tokens_per_s=tokens / total,
        mfu=model_flops_per_token * tokens / (total * peak),
        hfu=hw_flops / (total * peak),
    )


def _local_params(shape: ModelShape, strategy: Strategy, counts: list[int]) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of the largest stage (for gradient traffic)."""
    best = (0.0, 0.0)
    for i, n in enumerate(counts):
        n_moe = moe_layers_in(shape, n)
        dense = (
            (n - n_moe) * (shape.attention_params() + shape.mlp_params()) + n_moe * shape.attention_params()
        ) / strategy.tp
        if i == 0:
            dense += shape.embedding_params() / strategy.tp
        if i == strategy.pp - 1 and (not shape.tie_embeddings or strategy.pp > 1):
            dense += shape.vocab_size * shape.dim / strategy.tp
        expert = n_moe * math.ceil(shape.num_experts / strategy.ep) * shape.expert_params() / strategy.tp
        if dense + expert > sum(best):
            best = (dense, expert)
    return best
