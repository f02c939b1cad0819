"""Layout search: enumerate DP×TP×PP×CP×EP × micro-batch (× recompute), drop what does not fit or
cannot be built (with the reason), rank the rest by the analytic step-time model (``step_time``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from stalwart.plan.hardware import GB, Cluster
from stalwart.plan.memory import MemoryBreakdown, MemoryOptions, memory_per_gpu
from stalwart.plan.parallel import RECOMPUTE, Layout, Strategy
from stalwart.plan.shape import ModelShape
from stalwart.plan.step_time import StepModel, StepTime, step_time


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    num_micro_batches: int
    memory: MemoryBreakdown
    step: StepTime

    @property
    def layout(self) -> Layout:
        return self.strategy.layout

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.strategy.as_dict()
        out.update(
            num_micro_batches=self.num_micro_batches,
            memory_gb=self.memory.total / GB,
            step_time_s=self.step.total,
            tokens_per_s=self.step.tokens_per_s,
            mfu=self.step.mfu,
            hfu=self.step.hfu,
            exposed_comm_fraction=self.step.exposed_comm_fraction,
            memory_breakdown_gb=self.memory.gb(),
            step_breakdown_s={
                k: v for k, v in self.step.as_dict().items() if k not in ("total", "tokens_per_s", "mfu", "hfu")
            },
        )
        return out


@dataclass
class SearchResult:
    layouts: list[Candidate]  # feasible, best first (one per DP×TP×PP×CP×EP when deduplicated)
    rejected: Counter = field(default_factory=Counter)  # reason -> count of variants
    examples: dict[str, str] = field(default_factory=dict)  # reason -> one concrete message
    evaluated: int = 0
    smallest_oom: tuple[Strategy, MemoryBreakdown] | None = None  # the closest miss, for advice

    def rank_of(self, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> int | None:
        """1-based rank of a parallel layout among the feasible ones (None: infeasible/absent)."""
        for i, c in enumerate(self.layouts, 1):
            lo = c.layout
            if (lo.dp, lo.tp, lo.pp, lo.cp, lo.ep) == (dp, tp, pp, cp, ep):
                return i
        return None


# -- step time ----------------------------------------------------------------------------------
# -- search -------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(
    shape: ModelShape,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    model_flops_per_token: float,
    *,
    zero: int = 1,
    recompute: str = "auto",
    virtual_stages: int = 1,
    fixed: dict[str, int] | None = None,
    mem: MemoryOptions = MemoryOptions(),
    model: StepModel = StepModel(),
    dedupe: bool = True,
) -> SearchResult:
    """Every buildable layout of ``cluster.n_gpus`` GPUs, ranked by step time (fastest first).

    ``fixed`` pins any of dp, tp, pp, cp, ep, micro_batch. ``recompute="auto"`` tries none,
    selective and full and keeps the fastest that fits. With ``dedupe`` each DP×TP×PP×CP×EP layout
    appears once, with its best micro-batch and recompute choice.
    """
    if seq_len <= 0 or global_batch <= 0:
        raise ValueError(f"sequence length and global batch must be positive (got {seq_len}, {global_batch})")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    if virtual_stages < 1:
        raise ValueError(f"virtual pipeline stages must be >= 1, got {virtual_stages}")
    fixed = {k: v for k, v in (fixed or {}).items() if v}
    unknown = set(fixed) - {"dp", "tp", "pp", "cp", "ep", "micro_batch"}
    if unknown:
        raise ValueError(f"cannot pin {sorted(unknown)}; pin dp, tp, pp, cp, ep or micro_batch")
    recomputes = RECOMPUTE if recompute == "auto" else (recompute,)
    if recompute != "auto" and recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be auto or one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    n, gpn = cluster.n_gpus, cluster.gpus_per_node
    usable = cluster.gpu.memory_bytes * (1 - mem.headroom)
    prec = mem.precision
    result = SearchResult(layouts=[])

    def reject(reason: str, detail: str, count: int = 1) -> None:
        result.rejected[reason] += count
        result.examples.setdefault(reason, detail)

    def pick(key: str, options: list[int]) -> list[int]:
        return [fixed[key]] if key in fixed else options

    feasible: list[Candidate] = []
    for tp in pick("tp", _divisors(n)):
        if n % tp:
            reject("tp does not divide the GPU count", f"tp={tp} with {n} GPUs")
            continue
        if tp > gpn:
            reject("tp larger than a node", f"tp={tp} > {gpn} GPUs per node (TP stays on NVLink)")
            continue
        if shape.n_heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
            reject("heads not divisible by tp", f"tp={tp} vs {shape.n_heads} heads / {shape.kv_heads} kv heads")
            continue
        for cp in pick("cp", [c for c in _divisors(n // tp) if c <= model.max_cp]):
            if (n // tp) % cp:
                reject("layout does not multiply to the GPU count", f"tp={tp} cp={cp}")
                continue
            if cp > 1 and seq_len % (2 * cp):
                reject("sequence not divisible by 2·cp", f"cp={cp}, seq_len={seq_len}")
                continue
            if cp > 1 and "cp" not in fixed and seq_len // cp < model.min_cp_chunk:
                reject(
                    "sequence chunk per CP rank too short",
                    f"cp={cp}: {seq_len // cp} tokens per rank < {model.min_cp_chunk}",
                )
                continue
            for pp in pick("pp", _divisors(n // (tp * cp))):
                if pp * virtual_stages > shape.n_layers:
                    reject("more pipeline stages than layers", f"pp={pp}×v={virtual_stages} > {shape.n_layers} layers")
                    continue
                if (n // (tp * cp)) % pp:
                    reject("layout does not multiply to the GPU count", f"tp={tp} cp={cp} pp={pp}")
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                if global_batch % dp:
                    reject("global batch not divisible by dp", f"batch {global_batch} over dp={dp}")
                    continue
                if zero >= 2 and pp > 1:
                    reject(
                        "ZeRO-2/3 with pipeline parallelism",
                        f"zero={zero} pp={pp}: gradients are reduced per micro-batch "
                        "(unsupported in Megatron/DeepSpeed)",
                    )
                    continue
                eps = [1]
                if shape.is_moe:
                    eps = [e for e in _divisors(dp) if shape.num_experts % e == 0]
                for ep in pick("ep", eps):
                    if dp % ep or (shape.is_moe and shape.num_experts % ep) or (not shape.is_moe and ep > 1):
                        reject("ep must divide dp and the expert count", f"ep={ep}, dp={dp}")
                        continue
                    per_rank = global_batch // dp
                    mbs = [d for d in _divisors(per_rank) if d <= model.max_micro_batch]
                    for mb in pick("micro_batch", mbs):
                        if per_rank % mb:
                            reject(
                                "micro-batch does not divide the per-replica batch", f"mb={mb}, {per_rank} per replica"
                            )
                            continue
                        for rc in recomputes:
                            result.evaluated += 1
                            lo = Strategy.of(
                                dp,
                                tp,
                                pp,
                                cp,
                                ep,
                                micro_batch=mb,
                                virtual_stages=virtual_stages,
                                zero=zero,
                                recompute=rc,
                            )
                            m = lo.num_micro_batches(global_batch)
                            if virtual_stages > 1 and m % pp:
                                reject("interleaving needs micro-batches divisible by pp", f"m={m}, pp={pp}")
                                continue
                            mem_bd = memory_per_gpu(shape, lo, seq_len, global_batch, mem)
                            if mem_bd.total > usable:
                                if result.smallest_oom is None or mem_bd.total < result.smallest_oom[1].total:
                                    result.smallest_oom = (lo, mem_bd)
                                reject(
                                    "out of memory",
                                    f"dp={dp} tp={tp} pp={pp} cp={cp} ep={ep} mb={mb} {rc}: needs "
                                    f"{mem_bd.total / GB:.1f} GB > {usable / GB:.1f} GB usable",
                                )
                                continue
                            st = step_time(
                                shape,
                                lo,
                                cluster,
                                seq_len,
                                global_batch,
                                model_flops_per_token,
                                prec.activation_bytes,
                                prec.grad_bytes,
                                prec.weight_bytes,
                                mem.activations.sequence_parallel,
                                model,
                            )
                            feasible.append(Candidate(lo, m, mem_bd, st))
    feasible.sort(key=lambda c: (c.step.total, c.memory.total))
    if dedupe:
        seen: set[tuple[int, ...]] = set()
        unique = []
        for c in feasible:
            key = (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp, c.layout.ep)
            if key not in seen:
                seen.add(key)
                unique.append(c)
        feasible = unique
    result.layouts = feasible
    return result
