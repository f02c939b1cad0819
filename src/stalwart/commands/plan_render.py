"""What `stalwart plan` prints on a terminal: rich tables per section (``--json`` prints the dict)."""

from __future__ import annotations

import json
from typing import Any

from stalwart.commands.common import emit


def render_gpus(as_json: bool) -> int:
    from stalwart.plan.hardware import GPUS

    rows = {
        name: {
            "memory_gb": g.memory_gb,
            "peak_flops": g.peak_flops,
            "intra_node_gbps": g.intra_node_gbps,
            "inter_node_gbps": g.inter_node_gbps,
            "gpus_per_node": g.gpus_per_node,
            "source": g.source,
        }
        for name, g in GPUS.items()
    }
    if as_json:
        print(json.dumps({"gpus": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GPU table (dense bf16 peak; GB = 1e9 bytes; GB/s per GPU)")
    for col in ("gpu", "memory GB", "peak TFLOP/s", "NVLink GB/s", "network GB/s", "per node", "source"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['memory_gb']:.1f}",
            f"{r['peak_flops'] / 1e12:.0f}",
            f"{r['intra_node_gbps']:g}",
            f"{r['inter_node_gbps']:g}",
            str(r["gpus_per_node"]),
            r["source"],
        )
    Console().print(table)
    return 0


def render(result: dict[str, Any], section: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    nested = (
        "layouts",
        "memory_breakdown_gb",
        "policies",
        "layouts_rejected",
        "rejected_examples",
        "pipeline_bubble",
        "notes",
    )
    scalars = {k: v for k, v in result.items() if k not in nested}
    if scalars:
        emit(scalars, False, f"stalwart plan {section}")
    bd = result.get("memory_breakdown_gb")
    if bd:
        emit({k: v for k, v in bd.items()}, False, "memory per GPU of the best layout (GB)")
    layouts = result.get("layouts")
    if layouts is not None:
        table = Table(title=f"layouts, fastest first ({result.get('layouts_feasible', len(layouts))} fit)")
        cols = ("#", "dp", "tp", "pp", "cp", "ep", "mb", "recompute", "mem GB", "step s", "tokens/s", "MFU", "comm")
        for col in cols:
            table.add_column(col, justify="right")
        for i, lo in enumerate(layouts, 1):
            table.add_row(
                str(i),
                *(str(lo[k]) for k in ("dp", "tp", "pp", "cp", "ep", "micro_batch")),
                lo["recompute"],
                f"{lo['memory_gb']:.1f}",
                f"{lo['step_time_s']:.3g}",
                f"{lo['tokens_per_s']:.3g}",
                f"{lo['mfu']:.3f}",
                f"{lo['exposed_comm_fraction']:.0%}",
            )
        console.print(table)
        rejected = result.get("layouts_rejected") or {}
        if rejected:
            examples = result.get("rejected_examples", {})
            table = Table(title="rejected layout variants")
            table.add_column("reason")
            table.add_column("count", justify="right")
            table.add_column("example")
            for reason, count in rejected.items():
                table.add_row(reason, str(count), examples.get(reason, ""))
            console.print(table)
    bubble = result.get("pipeline_bubble")
    if bubble:
        lo = bubble["layout"]
        emit(
            {k: v for k, v in bubble.items() if k != "layout"},
            False,
            f"pipeline bubble of the fastest pipelined layout (dp={lo['dp']} tp={lo['tp']} pp={lo['pp']} "
            f"mb={lo['micro_batch']}) at 1× and 4× global batch",
        )
    policies = result.get("policies")
    if policies:
        table = Table(title="checkpoint policies, best first")
        for col in ("policy", "ETTR", "wall days", "failures", "lost days"):
            table.add_column(col, justify="right")
        for r in policies:
            table.add_row(
                str(r["name"]),
                f"{r['ettr']:.3f}",
                f"{r['wall_days']:.1f}",
                f"{r['expected_failures']:.0f}",
                f"{r['lost_days']:.1f}",
            )
        console.print(table)
    for note in result.get("notes") or []:
        console.print(f"note: {note}")
