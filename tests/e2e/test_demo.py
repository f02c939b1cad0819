"""`stalwart demo`, shortened: two agents, a kill and a hang, bitwise-equal final weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
KEYS = {"incidents", "goodput", "stall_s", "final_hash", "reference_hash", "bitwise_equal"}


def test_short_demo_recovers_from_kill_and_hang_to_the_reference_weights(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stalwart",
            "demo",
            "--steps",
            "24",
            "--faults",
            "kill,hang",
            "--hang-timeout",
            "5",
            "--out-dir",
            str(tmp_path / "demo"),
            "--json-report",
            str(report_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert json.loads(proc.stdout) == report, "--json prints the same report"
    assert set(report) >= KEYS
    assert report["bitwise_equal"] is True and report["final_hash"] == report["reference_hash"]
    assert report["reference_cached"] is False and report["restarts_used"] == 2
    kill, hang = report["incidents"]
    assert (kill["injected"], kill["at_step"], kill["kind"]) == ("kill", 8, "sigkill")
    assert (hang["injected"], hang["at_step"], hang["kind"]) == ("hang", 16, "hang")
    for incident in report["incidents"]:
        assert {"kind", "detected_s", "mttr_s", "lost_steps"} <= set(incident)
        assert 0 <= incident["detected_s"] <= incident["mttr_s"] < 120
    # Faults fire once the faulty rank's node holds the step's snapshot: the restart resumes where the
    # fault struck. Rank 0 is on the other node: its step-8 copy may have been in flight when its agent
    # stopped it after the kill (CI once: restored from step 7, step 8 trained again to the same weights,
    # as test_train_layouts allows). A stopped worker now finishes a copy under way (runtime/sigterm.py,
    # test_preempt), but one that had not yet started it, under load, still lacks step 8. A hang is
    # declared seconds later, every copy long done.
    assert kill["lost_steps"] in (0, 1) and hang["lost_steps"] == 0, report["incidents"]
    # A hang is declared once the rank was silent for the timeout, not before. The silence counts from
    # its last progress report, a few ms before the chaos stamps the hang's start (detected_s 4.998
    # once), so the journal's silence is checked, and detected_s only roughly.
    assert hang["detected_s"] > 4.5
    from stalwart.launch.journal import Journal

    hangs = [i for i in Journal(tmp_path / "demo" / "job" / "journal.sqlite").incidents() if i["kind"] == "hang"]
    assert hangs and all(min(i["details"]["silent_s"].values()) >= 5.0 for i in hangs), hangs
    assert 0 < report["goodput"] < 1 and report["stall_s"] >= 0
    assert "incident sigkill" in proc.stderr and "recovered from hang" in proc.stderr, "live console"
    cache = json.loads((tmp_path / "demo" / "reference.json").read_text())
    assert list(cache.values()) == [report["reference_hash"]], "the reference hash is cached by config"
