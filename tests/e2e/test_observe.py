"""Observability for real: `stalwart run` + `stalwart train`, separate processes, gloo, a kill and a
restart. One injected 1 s stall shows at exactly its (step, rank) in the per-rank records, and the
merged trace carries every rank, every step record and every journaled incident."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.launch.journal import INCIDENT_TIMES, Journal
from stalwart.observe.records import read_meta, read_records

pytestmark = pytest.mark.e2e
STEPS, STALL_STEP, STALL_RANK, KILL_STEP = 8, 3, 1, 5
STALL_S = 1.0  # well above a cold first forward after the restart on a loaded 2-core box (CI: >200 ms)


def stalwart(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stalwart", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def run_dir(stdlib_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("observe")
    run = tmp / "run"
    env = dict(os.environ, STALWART_CHAOS_DIR=str(tmp / "chaos"))
    chaos = f"kill:rank=0:step={KILL_STEP};delay:at=forward:step={STALL_STEP}:rank={STALL_RANK}:seconds={STALL_S}"
    launcher = ["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--hang-timeout", "5"]
    launcher += ["--run-dir", str(run), "--chaos", chaos]
    trainer = ["-m", "stalwart", "train", "--config", "configs/debug.toml", f"--data.dir={stdlib_data}"]
    trainer += ["--data.seq_len=32", f"--train.steps={STEPS}", "--train.warmup_steps=2", f"--train.out_dir={run}/train"]
    trainer += ["--checkpoint.enabled=true", f"--checkpoint.dir={tmp / 'ckpt'}", "--checkpoint.persist_every_steps=4"]
    stalwart(*launcher, *trainer, env=env)
    return run


def test_a_stall_shows_at_exactly_its_step_and_rank(run_dir: Path):
    records = {(r["step"], r["rank"]): r for r in read_records(run_dir)}  # a redone step: the later wins
    assert set(records) == {(s, r) for s in range(1, STEPS + 1) for r in (0, 1)}, "every rank, every step"
    forward = {key: r["ms"]["forward"] for key, r in records.items()}
    assert max(forward, key=forward.get) == (STALL_STEP, STALL_RANK)
    assert forward[(STALL_STEP, STALL_RANK)] >= 1000 * STALL_S
    stalled = records[(STALL_STEP, STALL_RANK)]
    assert stalled["ms"]["step"] >= stalled["ms"]["forward"] and stalled["compute_ms"] >= 1000 * STALL_S
    for r in records.values():  # the record carries the step's numbers, not just times
        assert {"data", "forward", "backward", "grad_clip", "optimizer", "checkpoint", "step"} <= set(r["ms"])
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["mem_mb"] > 0
        assert r["spans"][0][0] == "data"
    assert records[(2, 0)]["loss"] == records[(2, 1)]["loss"], "the global loss, the same on every rank"
    assert {m["coords"]["dp"] for m in read_meta(run_dir).values()} == {0, 1}


def test_trace_export_has_every_rank_step_and_incident(run_dir: Path, tmp_path: Path):
    out = tmp_path / "trace.json"
    summary = json.loads(stalwart("trace", "export", str(run_dir), "-o", str(out), "--json").stdout)
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    for e in events:  # Chrome trace event schema
        assert {"name", "ph", "pid", "tid"} <= set(e) and e["ph"] in ("M", "X", "i")
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"job", "rank 0 [dp0 pp0 tp0]", "rank 1 [dp1 pp0 tp0]"} <= names
    records = list(read_records(run_dir))
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == len(records) == summary["step_records"] >= 2 * STEPS
    [incident] = Journal(run_dir / "journal.sqlite").incidents()
    assert incident["kind"] == "sigkill"
    phases = [p for p in INCIDENT_TIMES if incident.get(p)]
    shown = [e["name"] for e in events if e.get("cat") == "incident"]
    assert shown == [f"sigkill: {p}" for p in phases] and len(phases) >= 3
    assert any(e.get("cat") == "recovery" for e in events)
    stall = [e for e in events if e["name"] == "forward" and e["pid"] == STALL_RANK + 1 and e["dur"] >= 200e3]
    assert stall, "the stall is on its rank's track"


def test_status_after_the_fact(run_dir: Path):
    status = json.loads(stalwart("status", str(run_dir), "--json").stdout)
    assert status["state"] == "finished" and not status["live"] and status["step"] == STEPS
    assert status["tokens_per_s"] > 0 and set(status["ranks"]) == {"0", "1"}
    [incident] = status["incidents"]
    assert incident["kind"] == "sigkill" and 0 < incident["detect_s"] <= incident["recover_s"]
    assert status["restarts_used"] == 1 and [n["step"] for n in status["nodes"]] == [STEPS]
    text = stalwart("status", str(run_dir)).stdout
    assert "finished" in text and "sigkill" in text and "recovered in" in text


def test_metrics_histograms_put_the_stall_in_its_bucket(run_dir: Path):
    """The master (restarted over the job's journal, as after a master failure) serves each rank's
    forward histogram as of the node's last heartbeat (up to ~3 s behind the rank: the final steps
    may be missing); rank 1's counts cover its steps before the restart, the stall among them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from stalwart.launch.master import Master

    token = (run_dir / "token").read_text().strip()
    master = Master(run_dir / "journal.sqlite", token).start()
    try:
        request = urllib.request.Request(master.address + "/metrics", headers={"Authorization": f"Bearer {token}"})
        text = urllib.request.urlopen(request, timeout=30).read().decode()
    finally:
        master.stop()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "stalwart_rank_section_ms"]
    forward = {
        s.labels["le"]: s.value
        for s in family.samples
        if s.name.endswith("_bucket") and s.labels["rank"] == str(STALL_RANK) and s.labels["section"] == "forward"
    }
    assert forward["+Inf"] >= KILL_STEP, "the restarted rank resumed its predecessor's counts"
    stalled_ms = {(r["step"], r["rank"]): r["ms"]["forward"] for r in read_records(run_dir)}[(STALL_STEP, STALL_RANK)]
    top = min(float(le) for le, n in forward.items() if n == forward["+Inf"])  # highest non-empty bucket's bound
    assert top >= stalled_ms > 200.0 and forward[str(int(top))] - forward.get("200", 0) >= 1


def test_a_pipeline_run_has_an_arrow_per_micro_batch_between_its_stages(stdlib_data: Path, tmp_path: Path):
    """dp2 × pp2, 2 steps of 2 micro-batches per pipeline: every stage rank records one forward span per
    micro-batch (the schedule's shape inference is not one), and the trace joins them with arrows."""
    out = tmp_path / "pp"
    trainer = ["train", "--config", "configs/debug.toml", "--nproc", "4", "--parallel.pp=2"]
    trainer += [f"--data.dir={stdlib_data}", "--data.seq_len=32", "--train.steps=2", "--train.warmup_steps=1"]
    trainer += [f"--train.out_dir={out}"]
    stalwart(*trainer)
    for r in read_records(out):
        stage = read_meta(out)[r["rank"]]["coords"]["pp"]
        assert [s[0] for s in r["spans"]].count(f"pp_fwd_s{stage}") == 2, r["spans"]
    stalwart("trace", "export", str(out), "-o", str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    flows = [e for e in events if e.get("cat") == "pp"]
    assert sorted(e["ph"] for e in flows) == ["f"] * 8 + ["s"] * 8, "2 steps × 2 pipelines × 2 micro-batches"
