"""docs/grafana-dashboard.json: valid JSON whose every query is valid PromQL (Prometheus' own `promtool
check rules`) over metric families the master exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"
EXPORTED = ("stalwart_last_step", "stalwart_restarts_used", "stalwart_stragglers", "stalwart_rank_section_ms")
EXPORTED += ("stalwart_node_section_ms", "stalwart_incidents", "stalwart_incident_recovery_seconds")
EXPORTED += ("stalwart_incident_detection_seconds",)


def _queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_queries_name_exported_families():
    for expr in _queries():
        for name in re.findall(r"stalwart_[a-z_]+", expr):
            assert any(name == f or name.startswith(f + "_") for f in EXPORTED), f"{name} is not exported"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus)")
def test_queries_are_valid_promql(tmp_path: Path):
    rules = {
        "groups": [{"name": "dashboard", "rules": [{"record": f"q{i}", "expr": e} for i, e in enumerate(_queries())]}]
    }
    (tmp_path / "rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
