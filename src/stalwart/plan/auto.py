"""``parallel.layout = "auto"``: the planner's fastest layout that fits and that the trainer can build.

Both ZeRO-0 (DDP / replicated) and ZeRO-3 (FSDP2) variants are searched with
:func:`stalwart.plan.layout.search`; the ranked candidates are filtered by what the trainer builds
(``Layout.check_model``: no CP, TP only on dense RoPE models, ...), and the choice is explained.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from stalwart.plan.compute import flops_per_token
from stalwart.plan.hardware import GB, Cluster, custom_gpu, get_gpu
from stalwart.plan.layout import search
from stalwart.plan.memory import MemoryOptions, get_precision
from stalwart.plan.parallel import Layout
from stalwart.plan.shape import ModelShape


@dataclass
class AutoLayout:
    layout: Layout
    micro_batch: int
    recompute: str
    why: str
    candidates: list[dict[str, Any]] = field(default_factory=list)  # top planner rows considered


def _device_spec(world_size: int, gpu: str | None, memory_gb: float | None) -> Any:
    if gpu:
        return custom_gpu(get_gpu(gpu), memory_gb=memory_gb)
    # CPU ranks on one host: memory is the host's share per rank; compute a nominal 1 TFLOP/s.
    if memory_gb is None:
        try:
            import psutil

            memory_gb = psutil.virtual_memory().total / 1e9 / max(1, world_size)
        except ImportError:  # pragma: no cover - psutil is a dependency
            memory_gb = 8.0
    return custom_gpu(
        None, peak_flops=1e12, memory_gb=memory_gb, intra_node_gbps=10.0, inter_node_gbps=10.0, gpus_per_node=world_size
    )


def _dp_kind(layout: Layout) -> str:
    if layout.uses_ddp:
        return "DDP"
    if layout.dp_shard > 1:
        return "FSDP2 ZeRO-3" + (" (HSDP)" if layout.dp_replicate > 1 else "")
    return "FSDP2 replicated (HSDP)" if layout.dp_replicate > 1 else "no data parallel"


def auto_layout(
    args: Any,
    world_size: int,
    seq_len: int,
    global_batch: int,
    *,
    moe: Any = None,
    micro_batch: int | None = None,
    gpu: str | None = None,
    memory_gb: float | None = None,
    precision: str | None = None,
    top: int = 3,
) -> AutoLayout:
    """The planner's fastest layout that fits and that this package can build.

    ``args`` is the ModelArgs, ``moe`` its MoEArgs (or None). ``gpu`` names a planner GPU (default:
    CPU ranks sharing this host's memory). Both ZeRO-0 (DDP/replicated) and ZeRO-3 (FSDP2)
    variants are searched; the planner's ranking (step time, then memory) decides.
    """
    shape = ModelShape.from_args(args, name="model")
    if moe is not None:
        shape = replace(
            shape,
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            expert_hidden=moe.expert_hidden or 0,
            moe_every=moe.moe_every,
        )
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
        layout = cand.layout  # ZeRO-0 without experts: replicas (DDP); otherwise FSDP2 shards
        try:
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
        raise ValueError(
            f"parallel = 'auto' found no layout of {world_size} ranks that fits and can be "
            f"built for this model and batch {global_batch}: {reasons or 'none evaluated'}; "
            f"give parallel = {{dp=.., tp=.., pp=..}} explicitly"
        )
    best, _, layout = buildable[0]
    usable = cluster.gpu.memory_bytes * (1 - mem.headroom)
    lines = [
        f"parallel = 'auto' chose {layout.describe()} "
        f"({_dp_kind(layout)}), micro_batch {best.strategy.micro_batch}, "
        f"recompute {best.strategy.recompute}",
        f"  why: fastest of {len(buildable)} buildable layouts by the planner's step-time model: "
        f"{best.step.total * 1e3:.3g} ms/step, {best.memory.total / GB:.3g} GB per rank of "
        f"{usable / GB:.3g} GB usable",
    ]
    for cand, _, other in buildable[1:top]:
        lines.append(
            f"  runner-up {other.describe()}: {cand.step.total / best.step.total:.2f}× the step time, "
            f"{cand.memory.total / GB:.3g} GB"
        )
    if rejected:
        lines.append(
            "  rejected: " + ", ".join(f"{k} ({v})" for k, v in sorted(rejected.items(), key=lambda kv: -kv[1])[:4])
        )
    return AutoLayout(
        layout,
        best.strategy.micro_batch,
        best.strategy.recompute,
        "\n".join(lines),
        [dict(c.as_dict(), zero=z) for c, z, _ in buildable[:top]],
    )
