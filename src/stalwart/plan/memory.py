"""Memory per GPU: model state (ZeRO 0-3), activations (Korthikanti et al. 2022) and working buffers.

Activations are counted tensor by tensor — what autograd keeps for the backward pass — so that the
paper's closed forms fall out as special cases (GELU MLP of 4h, multi-head attention, dropout,
fused LayerNorm: ``s·b·h·(34 + 5·a·s/h)`` bytes per layer in 16-bit) while SwiGLU, grouped-query
attention, FlashAttention, unfused norms, context and expert parallelism are covered by the same
count. Sizes are bytes; reports convert to decimal GB.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from stalwart.plan.compute import attended
from stalwart.plan.hardware import GB
from stalwart.plan.parallel import Strategy, moe_layers_in, partition_layers
from stalwart.plan.shape import ModelShape


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter (and per activation element) of each kind of state."""

    weight_bytes: float = 2.0  # working weights (bf16)
    grad_bytes: float = 2.0  # gradients as accumulated (4 when accumulated in fp32)
    master_bytes: float = 4.0  # fp32 master copy (0 when the weights are already fp32)
    optimizer_bytes: float = 8.0  # Adam m and v in fp32
    activation_bytes: float = 2.0  # saved activations
    grad_buffer_bytes: float = 0.0  # extra gradient communication buffer (PyTorch DDP buckets: = grad)
    optimizer_temp_bytes: float = 0.0  # step temporaries per param (unfused foreach Adam: 4)

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if value < 0:
                raise ValueError(f"{key.replace('_', '-')} must be >= 0, got {value}")
        if self.weight_bytes <= 0 or self.activation_bytes <= 0:
            raise ValueError("weight and activation bytes must be positive")

    @property
    def state_bytes_per_param(self) -> float:
        """Weights + gradients + optimizer state (the ZeRO paper's 2 + 2 + K with K = 12)."""
        return self.weight_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def checkpoint_bytes_per_param(self) -> float:
        """What a full training checkpoint stores: weights, master copy and optimizer state."""
        return self.weight_bytes + self.master_bytes + self.optimizer_bytes


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(),  # mixed precision with fp32 master weights (ZeRO paper: 16 B/param)
    "bf16-fp32grad": Precision(grad_bytes=4.0),  # Megatron's default fp32 gradient accumulation
    "fp32": Precision(4.0, 4.0, 0.0, 8.0, 4.0),  # plain fp32 training (e.g. on CPU)
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None


@dataclass(frozen=True)
class ActivationOptions:
    """How the implementation stores activations (each switch changes which tensors are saved)."""

    sequence_parallel: bool = True  # Megatron SP: norm/dropout activations split over TP too
    flash_attention: bool = True  # attention core keeps only its output and log-sum-exp
    dropout: bool = False  # dropout masks (1 byte per element) and dropout outputs
    fused_norm: bool = True  # False: an unfused norm also keeps its normalised input (eager RMSNorm)


@dataclass(frozen=True)
class MemoryOptions:
    precision: Precision = field(default_factory=Precision)
    activations: ActivationOptions = field(default_factory=ActivationOptions)
    headroom: float = 0.10  # fraction of device memory kept free (CUDA context, NCCL, fragmentation)
    # ZeRO-Offload / FSDP2 CPUOffloadPolicy: what ZeRO shards lives on the host (optimizer state always,
    # gradients from ZeRO-2, weights at ZeRO-3); the device keeps only what it computes with.
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.headroom < 1:
            raise ValueError(f"memory headroom must be a fraction in [0, 1), got {self.headroom}")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak memory of the most loaded pipeline stage, by kind (bytes)."""

    weights: float
    grads: float
    grad_buffer: float
    optimizer: float
    activations: float
    logits: float
    working: float
    zero3_buffers: float
    optimizer_temp: float
    stage: str  # which pipeline stage is the peak: only | first | last
    phase: str  # forward-backward | optimizer-step
    offloaded: float = 0.0  # state held in host memory instead (MemoryOptions.cpu_offload), not in total

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.grad_buffer + self.optimizer

    @property
    def forward_backward(self) -> float:
        return self.state + self.activations + self.logits + self.working + self.zero3_buffers

    @property
    def optimizer_step(self) -> float:
        return self.state + self.optimizer_temp

    @property
    def total(self) -> float:
        return max(self.forward_backward, self.optimizer_step)

    def gb(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {k: v / GB for k, v in asdict(self).items() if isinstance(v, float)}
        out["total"] = self.total / GB
        out["stage"], out["phase"] = self.stage, self.phase
        return out


# -- activations ---------------------------------------------------------------------------------
def layer_activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    cp: int = 1,
    recompute: str = "none",
    opts: ActivationOptions = ActivationOptions(),
    act_bytes: float = 2.0,
    moe_layer: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one GPU.

    Replicated across TP ranks unless sequence parallel: the two norms' inputs/outputs and dropout
    masks. Split by TP: Q, K, V, the attention output, MLP intermediates, the attention core.
    Everything is split by CP (each rank holds seq_len / cp tokens).
    """
    s_loc = seq_len / cp
    sbh = s_loc * micro_batch * shape.dim
    rep_div = tp if opts.sequence_parallel else 1
    if recompute == "full":  # only the layer input is checkpointed
        return sbh * act_bytes / rep_div
    tensors_per_norm = 2 if opts.fused_norm else 3  # input, (normalised,) output
    replicated = shape.norms_per_layer * tensors_per_norm * sbh * act_bytes + (2 * sbh if opts.dropout else 0.0)
    split = s_loc * micro_batch * (shape.dim + 2 * shape.kv_dim) * act_bytes  # Q, K, V
    split += sbh * act_bytes  # attention output = input of the output projection
    per_hidden = 2 if shape.mlp == "gelu" else 4  # gelu in/out; swiglu: w1 out, silu out, w3 out, product
    if moe_layer:
        routed = shape.top_k * s_loc * micro_batch
        split += routed * (per_hidden * shape.expert_ffn + 2 * shape.dim) * act_bytes  # + dispatch/combine
        split += s_loc * micro_batch * shape.num_experts * 4 * tp  # fp32 router logits, not split
    else:
        split += per_hidden * s_loc * micro_batch * shape.ffn_hidden * act_bytes
    heads_s = shape.n_heads * s_loc * micro_batch
    if recompute == "none" and not opts.flash_attention:  # softmax (+ dropout mask and output)
        split += (
            heads_s * attended(seq_len, shape.attn_window) * (act_bytes + ((1 + act_bytes) if opts.dropout else 0.0))
        )
    elif opts.flash_attention:
        split += heads_s * 4  # fp32 log-sum-exp
    return replicated / rep_div + split / tp


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """The paper's closed forms (GPT: GELU 4h MLP, MHA, dropout, 16-bit), for reference and tests."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    core = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + core) / t
    return s * b * h * (10 + 24 / t + core / t)


# -- per-stage totals ----------------------------------------------------------------------------
def _stage_params(
    shape: ModelShape, strategy: Strategy, n_layers: int, first: bool, last: bool
) -> tuple[float, float, float]:
    """(dense, expert, largest layer) parameters held by one GPU of a stage, before ZeRO."""
    tp = strategy.tp
    n_moe = moe_layers_in(shape, n_layers)
    norms = shape.norms_per_layer * shape.norm_params()
    dense_layer = (shape.attention_params() + shape.mlp_params()) / tp + norms
    moe_layer = shape.attention_params() / tp + norms + shape.router_params()
    dense = (n_layers - n_moe) * dense_layer + n_moe * moe_layer
    experts_local = math.ceil(shape.num_experts / strategy.ep) if shape.is_moe else 0
    expert = n_moe * experts_local * shape.expert_params() / tp
    largest = max(
        dense_layer if n_layers > n_moe else 0.0,
        moe_layer + experts_local * shape.expert_params() / tp if n_moe else 0.0,
    )
    if first:
        dense += shape.embedding_params() / tp
    if last:
        dense += shape.norm_params()
        if not shape.tie_embeddings or (strategy.pp > 1 and not first):
            dense += shape.vocab_size * shape.dim / tp
    return dense, expert, largest


def stage_memory(
    shape: ModelShape,
    strategy: Strategy,
    seq_len: int,
    num_micro: int,
    stage: int,
    opts: MemoryOptions = MemoryOptions(),
) -> MemoryBreakdown:
    """Peak memory of one GPU in pipeline stage ``stage`` (0-based)."""
    p, prec, act = strategy.pp, opts.precision, opts.activations
    counts = partition_layers(shape.n_layers, p, shape.head_flop_share())
    first, last = stage == 0, stage == p - 1
    n_layers = counts[stage]
    dense, expert, largest = _stage_params(shape, strategy, n_layers, first, last)
    z = strategy.zero_group
    z_exp = max(1, z // strategy.ep)
    local = dense + expert

    def sharded(stage_min: int) -> float:
        return dense / z + expert / z_exp if strategy.zero >= stage_min else local

    weights = prec.weight_bytes * sharded(3)
    grads = prec.grad_bytes * sharded(2)
    optimizer = (prec.master_bytes + prec.optimizer_bytes) * sharded(1)
    grad_buffer = prec.grad_buffer_bytes * local
    zero3 = 2 * largest * prec.weight_bytes if strategy.zero == 3 else 0.0
    opt_temp = prec.optimizer_temp_bytes * sharded(1)
    offloaded = 0.0
    if opts.cpu_offload:  # the sharded state moves to the host; the optimizer step runs there
        offloaded = (
            optimizer + opt_temp + (grads if strategy.zero >= 2 else 0.0) + (weights if strategy.zero == 3 else 0.0)
        )
        optimizer = opt_temp = 0.0
        grads = 0.0 if strategy.zero >= 2 else grads
        weights = 0.0 if strategy.zero == 3 else weights

    # Activations: 1F1B keeps min(m, p - stage) micro-batches in flight; interleaving (v chunks)
    # raises the first stage's share by (1 + (p - 1) / (p·v)) (Korthikanti et al. 2022, §4.2.3).
    in_flight = min(num_micro, p - stage)
    if first and strategy.virtual_stages > 1 and p > 1:
        in_flight *= 1 + (p - 1) / (p * strategy.virtual_stages)
    n_moe = moe_layers_in(shape, n_layers)
    kw = dict(tp=strategy.tp, cp=strategy.cp, opts=act, act_bytes=prec.activation_bytes)
    b = strategy.micro_batch
    per_mb = (n_layers - n_moe) * layer_activation_bytes(
        shape, seq_len, b, recompute=strategy.recompute, **kw
    ) + n_moe * layer_activation_bytes(shape, seq_len, b, recompute=strategy.recompute, moe_layer=True, **kw)
    activations = per_mb * in_flight
    s_loc = seq_len / strategy.cp
    rep_div = strategy.tp if act.sequence_parallel else 1
    logits = 0.0
    working = 0.0
    one_layer_full = layer_activation_bytes(shape, seq_len, b, recompute="none", moe_layer=n_moe > 0, **kw)
    if strategy.recompute == "full":  # a layer's activations are rebuilt during its backward
        working = one_layer_full
    elif strategy.recompute == "selective" and not act.flash_attention:  # one attention core rebuilt
        working = shape.n_heads * s_loc * b * seq_len * prec.activation_bytes / strategy.tp
    widest = max(shape.ffn_hidden if not shape.is_moe else shape.top_k * shape.expert_ffn, shape.dim)
    working += 2 * s_loc * b * widest * prec.activation_bytes / strategy.tp  # gradients in flight
    if last:
        norm_tensors = 2 if act.fused_norm else 3
        activations += norm_tensors * s_loc * b * shape.dim * prec.activation_bytes / rep_div
        vocab_local = s_loc * b * shape.vocab_size / strategy.tp
        logits = vocab_local * (prec.activation_bytes + 4)  # logits + fp32 log-probs for the loss
        working = max(working, 8 * vocab_local)  # fp32 gradients of log-probs and logits
    name = "only" if p == 1 else ("first" if first else "last" if last else f"stage{stage}")
    bd = MemoryBreakdown(
        weights, grads, grad_buffer, optimizer, activations, logits, working, zero3, opt_temp, name, "", offloaded
    )
    return replace(bd, phase="forward-backward" if bd.forward_backward >= bd.optimizer_step else "optimizer-step")


def memory_per_gpu(
    shape: ModelShape,
    strategy: Strategy,
    seq_len: int,
    global_batch: int | None = None,
    opts: MemoryOptions = MemoryOptions(),
) -> MemoryBreakdown:
    """Peak over pipeline stages (the first holds embeddings and the most in-flight micro-batches,
    the last the LM head and logits). ``global_batch`` sets the micro-batch count (default: many)."""
    if seq_len <= 0:
        raise ValueError(f"sequence length must be positive, got {seq_len}")
    if strategy.pp > shape.n_layers:
        raise ValueError(f"pipeline stages ({strategy.pp}) exceed the model's layers ({shape.n_layers})")
    num_micro = strategy.num_micro_batches(global_batch) if global_batch else strategy.pp
    stages = {0, strategy.pp - 1}
    return max((stage_memory(shape, strategy, seq_len, num_micro, s, opts) for s in stages), key=lambda m: m.total)


# -- whole-model figures (seed arithmetic) -------------------------------------------------------
def model_state_bytes(n_params: float, bytes_per_param: float) -> float:
    """All copies of the model state at ``bytes_per_param`` (2: bf16 weights; 16: mixed Adam)."""
    if n_params <= 0 or bytes_per_param <= 0:
        raise ValueError("parameters and bytes per parameter must be positive")
    return n_params * bytes_per_param


def min_gpus_for(total_bytes: float, gpu_memory_bytes: float) -> int:
    """GPUs needed just to hold ``total_bytes`` when spread perfectly (a lower bound)."""
    if gpu_memory_bytes <= 0:
        raise ValueError("GPU memory must be positive")
    return math.ceil(total_bytes / gpu_memory_bytes)


def min_nodes_for(total_bytes: float, gpu_memory_bytes: float, gpus_per_node: int) -> int:
    return math.ceil(min_gpus_for(total_bytes, gpu_memory_bytes) / gpus_per_node)
