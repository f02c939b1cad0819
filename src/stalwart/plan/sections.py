"""The sections of a plan's answer (memory, layout, reliability), each a JSON-ready dict."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stalwart.plan import reliability
from stalwart.plan.hardware import GB, Cluster
from stalwart.plan.layout import SearchResult, StepModel, step_time
from stalwart.plan.memory import MemoryOptions
from stalwart.plan.shape import ModelShape

if TYPE_CHECKING:
    from stalwart.plan.api import PlanInputs  # the caller's inputs (api imports this module)


def finite(value: Any) -> Any:
    """Non-finite floats become None so that the result is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def memory_section(
    shape: ModelShape, n_params: float, cluster: Cluster, mem: MemoryOptions, found: SearchResult, notes: list[str]
) -> dict[str, Any]:
    prec = mem.precision
    state = n_params * prec.state_bytes_per_param
    gpu = cluster.gpu
    out: dict[str, Any] = {
        "gpu_memory_gb": gpu.memory_gb if math.isfinite(gpu.memory_bytes) else None,
        "usable_memory_gb": gpu.memory_gb * (1 - mem.headroom) if math.isfinite(gpu.memory_bytes) else None,
        "weights_gb": n_params * prec.weight_bytes / GB,
        "model_state_gb": state / GB,
        "model_state_bytes_per_param": prec.state_bytes_per_param,
        "min_nodes_for_model_state": (
            math.ceil(state / (gpu.memory_bytes * gpu.gpus_per_node)) if math.isfinite(gpu.memory_bytes) else None
        ),
    }
    if found.layouts:
        bd = found.layouts[0].memory
        out.update(memory_per_gpu_gb=bd.total / GB, memory_breakdown_gb=bd.gb(), memory_fits=True)
    elif found.smallest_oom is not None:
        lo, bd = found.smallest_oom
        out.update(memory_per_gpu_gb=bd.total / GB, memory_breakdown_gb=bd.gb(), memory_fits=False)
        notes.append(
            f"no layout fits; the smallest need is {bd.total / GB:.1f} GB per GPU "
            f"(dp={lo.dp} tp={lo.tp} pp={lo.pp} mb={lo.micro_batch} {lo.recompute})"
        )
    else:
        out.update(memory_per_gpu_gb=None, memory_breakdown_gb=None, memory_fits=False)
        notes.append("no buildable layout for this GPU count and batch; see layouts_rejected")
    return out


def layout_section(found: SearchResult, top: int) -> dict[str, Any]:
    return {
        "layouts": [c.as_dict() for c in found.layouts[:top]],
        "layouts_feasible": len(found.layouts),
        "layouts_evaluated": found.evaluated,
        "layouts_rejected": dict(found.rejected.most_common()),
        "rejected_examples": found.examples,
    }


def bubble_section(
    shape: ModelShape,
    found: SearchResult,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    flops_per_token: float,
    mem: MemoryOptions,
    model: StepModel,
    scale: int = 4,
) -> dict[str, Any] | None:
    """The pipeline bubble's share of the step for the fastest pipelined layout, at the global batch
    and at ``scale``× it with the same layout and micro-batch (MegaScale: LAMB lets the batch grow
    4×, so each step runs 4× the micro-batches through the same fill and drain). None without PP."""
    best = next((c for c in found.layouts if c.layout.pp > 1), None)
    if best is None:
        return None
    prec = mem.precision
    shares = []
    for batch in (global_batch, scale * global_batch):
        st = step_time(
            shape,
            best.strategy,
            cluster,
            seq_len,
            batch,
            flops_per_token,
            prec.activation_bytes,
            prec.grad_bytes,
            prec.weight_bytes,
            mem.activations.sequence_parallel,
            model,
        )
        shares.append(st.bubble / st.total)
    return {
        "layout": best.strategy.as_dict(),
        "global_batch": global_batch,
        "bubble_share": shares[0],
        f"global_batch_{scale}x": scale * global_batch,
        f"bubble_share_{scale}x": shares[1],
        "bubble_share_cut": 1 - shares[1] / shares[0] if shares[0] > 0 else 0.0,
    }


def reliability_section(
    inp: PlanInputs, cluster: Cluster, n_params: float, mem: MemoryOptions, best: Any, days: float
) -> dict[str, Any]:
    n = cluster.n_gpus
    mtbf_h = reliability.job_mtbf_hours(
        n, p_gpu_day=inp.gpu_fail_per_day, n_nodes=cluster.n_nodes, node_mtbf_hours=inp.node_mtbf_hours
    )
    mtbf_s = mtbf_h * 3600
    ckpt_bytes = n_params * mem.precision.checkpoint_bytes_per_param
    stall = inp.ckpt_stall_s if inp.ckpt_stall_s is not None else ckpt_bytes / (inp.ckpt_write_gbps * GB)
    interval = reliability.daly_interval(stall, mtbf_s) if stall > 0 else math.inf
    policies = [
        reliability.Policy(
            f"storage every {inp.disk_interval_hours:g}h", inp.disk_interval_hours * 3600, stall, inp.restart_s
        )
    ]
    if math.isfinite(interval):
        policies.append(reliability.Policy("storage at Daly interval", interval, stall, inp.restart_s))
    if best is not None and inp.snapshot_every > 0:
        per_gpu = best.memory.weights + best.memory.optimizer
        policies.append(
            reliability.Policy(
                f"memory every {inp.snapshot_every} steps + storage every {inp.disk_interval_hours:g}h",
                inp.disk_interval_hours * 3600,
                stall,
                inp.restart_s,
                snapshot_interval_s=inp.snapshot_every * best.step.total,
                snapshot_stall_s=per_gpu / (inp.host_copy_gbps * GB),
                snapshot_restart_s=inp.snapshot_restart_s,
                snapshot_recoverable=inp.snapshot_recoverable,
            )
        )
    rows = reliability.compare_policies(policies, mtbf_s, days)
    e = (
        reliability.ettr(interval, stall, inp.restart_s, mtbf_s)
        if math.isfinite(interval)
        else reliability.ettr(policies[0].interval_s, stall, inp.restart_s, mtbf_s)
    )
    return {
        "p_fail_gpu_day": inp.gpu_fail_per_day,
        "p_fail_day": reliability.p_any_failure(inp.gpu_fail_per_day, n),
        "mtbf_hours": mtbf_h,
        "expected_failures": days * 24 / mtbf_h,
        "checkpoint_gb": ckpt_bytes / GB,
        "checkpoint_stall_s": stall,
        "checkpoint_interval_s": interval if math.isfinite(interval) else None,
        "checkpoint_interval_young_s": reliability.young_interval(stall, mtbf_s) if stall > 0 else None,
        "ettr": e,
        "wall_days": days / e if e > 0 else None,
        "policies": rows,
    }
