"""Output helpers shared by subcommands: one JSON object for machines, a table for people."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def emit(result: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        print(json.dumps(result, default=str))
        return
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in result.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        table.add_row(key, str(value))
    Console().print(table)


def fail(message: str, code: int = 2) -> int:
    print(f"stalwart: error: {message}", file=sys.stderr)
    return code
