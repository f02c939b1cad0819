"""`stalwart plan [time|memory|layout|reliability|gpus]`: size a pretraining run before renting it."""

from __future__ import annotations

import argparse
import json
from typing import Any

SECTIONS = ("summary", "time", "memory", "layout", "reliability", "gpus")
SECTION_KEYS = {
    "time": (
        "model",
        "n_params",
        "gpu",
        "gpus",
        "gpu_peak_flops",
        "tokens",
        "seq_len",
        "solved_for",
        "flops_per_token",
        "total_flops",
        "mfu",
        "mfu_source",
        "days",
        "gpu_hours",
        "notes",
    ),
    "memory": (
        "model",
        "n_params",
        "gpu",
        "gpus",
        "weights_gb",
        "model_state_gb",
        "model_state_bytes_per_param",
        "min_nodes_for_model_state",
        "gpu_memory_gb",
        "usable_memory_gb",
        "memory_per_gpu_gb",
        "memory_breakdown_gb",
        "memory_fits",
        "notes",
    ),
    "layout": (
        "model",
        "gpu",
        "gpus",
        "seq_len",
        "global_batch",
        "layouts",
        "layouts_feasible",
        "layouts_evaluated",
        "layouts_rejected",
        "rejected_examples",
        "pipeline_bubble",
        "notes",
    ),
    "reliability": (
        "gpus",
        "nodes",
        "days",
        "p_fail_gpu_day",
        "p_fail_day",
        "mtbf_hours",
        "expected_failures",
        "checkpoint_gb",
        "checkpoint_stall_s",
        "checkpoint_interval_s",
        "checkpoint_interval_young_s",
        "ettr",
        "wall_days",
        "policies",
        "notes",
    ),
}

EPILOG = """\
units: counts accept K, M, B (or G), T, P suffixes (powers of 1000) or exponents: 175B = 175e9.
  Memory is decimal GB (1e9 bytes); bandwidth GB/s per GPU; FLOP/s per GPU (dense bf16).

examples:
  stalwart plan --model gpt3-175b --gpu h100 --gpus 8192 --tokens 10T --mfu 0.5
  stalwart plan time --params 175e9 --gpu-flops 147e12 --mfu 1 --gpus 992 --tokens 300B
  stalwart plan layout --model bloom-176b --gpu a100-80g --gpus 384 --global-batch 2048 --zero 1
  stalwart plan --model llama3-70b --gpu h100 --days 30 --tokens 15T --mfu 0.4   # solve for GPUs
  stalwart plan reliability --model llama3-405b --gpu h100 --gpus 16384 --tokens 15T
  stalwart plan gpus                                               # the GPU table
Formulas and sources: docs/plan.md.
"""


def _count(what: str):
    def parse(text: str) -> float:
        from stalwart.plan.units import parse_count

        try:
            return parse_count(text, what)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = what
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="estimate days, memory per GPU, parallel layout, failures and checkpointing",
        description="Plan a pretraining run: compute and days, memory per GPU (ZeRO, TP/PP/CP/EP, "
        "recompute), the fastest parallel layouts that fit, failure odds, the optimal "
        "checkpoint interval and the expected goodput (ETTR). Pure arithmetic, no GPUs needed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "section",
        nargs="?",
        choices=(*SECTIONS, "simulate"),
        default="summary",
        help="what to show (default summary: everything; `--json` then prints the whole plan); "
        "simulate: a discrete-event simulation of ETTR under failures per recovery policy",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")

    g = p.add_argument_group("model")
    g.add_argument("--model", help="registry model name (e.g. gpt3-175b, llama3-70b, bloom-176b, falcon-180b)")
    g.add_argument(
        "--params", metavar="N", type=_count("--params"), help="raw parameter count instead of --model (e.g. 175e9)"
    )
    g.add_argument("--layers", type=int, help="transformer layers (override or custom shape)")
    g.add_argument("--dim", type=int, help="hidden size h (override or custom shape)")
    g.add_argument("--heads", type=int, help="attention heads a (default dim/128 for a custom shape)")
    g.add_argument("--kv-heads", type=int, help="key/value heads for grouped-query attention (default: heads)")
    g.add_argument("--ffn-hidden", type=int, help="MLP hidden size (default 4·dim for a custom shape)")
    g.add_argument("--vocab", type=int, help="vocabulary size (default 50257 for a custom shape)")
    g.add_argument("--experts", type=int, default=0, help="MoE: experts per MoE layer (default 0 = dense)")
    g.add_argument(
        "--experts-per-token", type=int, default=2, help="MoE: experts each token is routed to (top-k, default 2)"
    )
    g.add_argument("--expert-ffn", type=int, default=0, help="MoE: expert MLP hidden size (default: --ffn-hidden)")
    g.add_argument("--moe-every", type=int, default=1, help="MoE: every k-th layer is MoE (default 1)")
    g.add_argument(
        "--parallel-block",
        action="store_true",
        help="attention and MLP from one norm, summed (MegaScale): one TP reduction per layer instead of two",
    )
    g.add_argument(
        "--attn-window", type=int, default=0, metavar="TOKENS", help="sliding-window attention (default 0 = full)"
    )
    g.add_argument("--embed-norm", action="store_true", help="LayerNorm after the embedding (BLOOM)")

    g = p.add_argument_group("data and time")
    g.add_argument(
        "--tokens",
        metavar="N",
        type=_count("--tokens"),
        help="training tokens, count (e.g. 10T; default 20 per parameter)",
    )
    g.add_argument("--seq-len", metavar="TOKENS", type=int, help="tokens per sequence (default: the model's context)")
    g.add_argument(
        "--global-batch",
        metavar="SEQS",
        type=int,
        help="sequences per optimizer step (default: 4M tokens, doubled until every GPU gets one sequence)",
    )
    g.add_argument(
        "--mfu",
        metavar="FRACTION",
        type=float,
        help="model FLOPs utilisation in (0, 1] for the day count (default: the best layout's predicted MFU)",
    )
    g.add_argument(
        "--days", metavar="DAYS", type=float, help="deadline in days: solves for --gpus (if not given) or --tokens"
    )
    g.add_argument(
        "--attention-flops",
        action="store_true",
        help="count the attention term 12·L·h·s FLOPs per token (default: 6·N only)",
    )

    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", help="GPU type from the table (`stalwart plan gpus`): h100, h200, a100-80g, a100-40g, ...")
    g.add_argument("--gpus", metavar="N", type=int, help="number of GPUs")
    g.add_argument(
        "--gpu-flops",
        metavar="FLOP/S",
        type=_count("--gpu-flops"),
        help="peak dense bf16 FLOP/s per GPU (e.g. 989e12); overrides --gpu",
    )
    g.add_argument(
        "--gpu-memory",
        metavar="GB",
        type=float,
        dest="gpu_memory_gb",
        help="memory per GPU in GB (1e9 bytes); overrides --gpu",
    )
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    g.add_argument("--intra-node-gbps", metavar="GB/S", type=float, help="NVLink bandwidth, GB/s per GPU per direction")
    g.add_argument(
        "--inter-node-gbps",
        metavar="GB/S",
        type=float,
        help="network bandwidth, GB/s per GPU (node NICs ÷ GPUs per node)",
    )

    g = p.add_argument_group("memory")
    g.add_argument(
        "--precision",
        default="bf16",
        help="bf16 (2+2+4+8 B/param), bf16-fp32grad (2+4+4+8) or fp32 (4+4+0+8); default bf16",
    )
    g.add_argument("--weight-bytes", metavar="BYTES", type=float, help="bytes per weight (overrides --precision)")
    g.add_argument("--grad-bytes", metavar="BYTES", type=float, help="bytes per gradient")
    g.add_argument(
        "--master-bytes", metavar="BYTES", type=float, help="bytes per fp32 master weight (0 when training in fp32)"
    )
    g.add_argument(
        "--optimizer-bytes",
        metavar="BYTES",
        type=float,
        help="bytes of optimizer state per parameter (Adam m+v fp32: 8)",
    )
    g.add_argument(
        "--activation-bytes", metavar="BYTES", type=float, help="bytes per saved activation element (bf16: 2)"
    )
    g.add_argument(
        "--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage over data parallel (default 1)"
    )
    g.add_argument(
        "--recompute",
        default="auto",
        choices=("auto", "none", "selective", "full"),
        help="activation recomputation; auto tries all and keeps the fastest that fits (default)",
    )
    g.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="disable Megatron sequence parallelism",
    )
    g.add_argument(
        "--no-flash-attention", dest="flash_attention", action="store_false", help="store the s×s attention scores"
    )
    g.add_argument("--dropout", action="store_true", help="count dropout masks (models trained with dropout)")
    g.add_argument(
        "--cpu-offload",
        action="store_true",
        help="ZeRO-sharded state (optimizer; gradients from --zero 2, weights at 3) in host memory",
    )
    g.add_argument(
        "--headroom",
        metavar="FRACTION",
        type=float,
        default=0.10,
        help="fraction of GPU memory kept free (default 0.10)",
    )

    g = p.add_argument_group("layout (pin any dimension; the rest is searched)")
    for dim, text in (
        ("dp", "data-parallel replicas"),
        ("tp", "tensor-parallel GPUs (at most one node)"),
        ("pp", "pipeline stages"),
        ("cp", "context-parallel GPUs (sequence split)"),
        ("ep", "expert-parallel GPUs (MoE; divides dp)"),
    ):
        g.add_argument(f"--{dim}", type=int, metavar="N", help=f"pin the number of {text}")
    g.add_argument("--micro-batch", metavar="SEQS", type=int, help="sequences per micro-batch")
    g.add_argument("--virtual-stages", type=int, default=1, help="interleaved pipeline chunks per GPU (default 1)")
    g.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    g.add_argument(
        "--compute-efficiency",
        metavar="FRACTION",
        type=float,
        default=0.60,
        help="fraction of peak reached by wide matmuls in the step-time model (default 0.60)",
    )
    g.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="model data-parallel communication as not overlapped with compute (stalwart overlaps it by default: "
        "DDP buckets during the backward, FSDP2 prefetch; docs/techniques.md)",
    )

    g = p.add_argument_group("reliability")
    g.add_argument(
        "--gpu-fail-per-day",
        metavar="PROB",
        type=float,
        default=0.001,
        help="probability one GPU fails on a given day (default 0.001)",
    )
    g.add_argument(
        "--node-mtbf-hours",
        metavar="HOURS",
        type=float,
        default=0.0,
        help="extra node-level MTBF in hours (default: none)",
    )
    g.add_argument(
        "--ckpt-write-gbps",
        metavar="GB/S",
        type=float,
        default=100.0,
        help="aggregate storage write bandwidth, GB/s (default 100)",
    )
    g.add_argument(
        "--ckpt-stall-s",
        metavar="SECONDS",
        type=float,
        help="seconds training stalls per storage checkpoint (default: size ÷ bandwidth)",
    )
    g.add_argument(
        "--restart-s",
        metavar="SECONDS",
        type=float,
        default=600.0,
        help="seconds to detect, restart and reload from storage (default 600)",
    )
    g.add_argument(
        "--disk-interval-hours",
        metavar="HOURS",
        type=float,
        default=3.0,
        help="fixed storage interval to compare, hours (default 3)",
    )
    g.add_argument(
        "--snapshot-every", metavar="STEPS", type=int, default=10, help="steps between in-memory snapshots (default 10)"
    )
    g.add_argument(
        "--snapshot-restart-s",
        metavar="SECONDS",
        type=float,
        default=120.0,
        help="seconds to restart from a memory snapshot (default 120)",
    )
    g.add_argument(
        "--snapshot-recoverable",
        metavar="FRACTION",
        type=float,
        default=0.9,
        help="fraction of failures a memory snapshot survives (default 0.9)",
    )
    g.add_argument(
        "--host-copy-gbps",
        metavar="GB/S",
        type=float,
        default=20.0,
        help="GPU→host copy bandwidth per GPU, GB/s (default 20)",
    )
    from stalwart.commands.plan_simulate import add_arguments

    add_arguments(p)
    p.set_defaults(handler=run)


def inputs_from_args(args: argparse.Namespace):
    from stalwart.plan.api import PlanInputs

    fields = PlanInputs.__dataclass_fields__
    return PlanInputs(**{k: v for k, v in vars(args).items() if k in fields and k != "notes"})


def run(args: argparse.Namespace, overrides: dict[str, Any], raw_argv: list[str]) -> int:
    if args.section == "simulate":
        from stalwart.commands.plan_simulate import run_simulate

        return run_simulate(args)
    if args.section == "gpus":
        from stalwart.commands.plan_render import render_gpus

        return render_gpus(args.json)
    from stalwart.plan.api import plan

    result = plan(inputs_from_args(args))
    if args.section != "summary":
        result = {k: result[k] for k in SECTION_KEYS[args.section] if k in result}
    if args.json:
        print(json.dumps(result, default=str))
    else:
        from stalwart.commands.plan_render import render

        render(result, args.section)
    return 0
