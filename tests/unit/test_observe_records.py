"""Per-rank step records: the section timer's step tags and spans, user sections, the record join."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import stalwart
from stalwart import runtime
from stalwart.observe.records import RankRecords, read_meta, read_records, records_path
from stalwart.observe.timers import SectionTimer


@pytest.fixture
def timer():
    t = SectionTimer()
    runtime.set_section_timer(t)
    yield t
    runtime.set_section_timer(None)


def test_user_sections_join_the_step_with_spans_in_order(timer: SectionTimer):
    timer.begin_step(5)
    with timer.section("data"):
        pass
    with stalwart.timer("my_eval"):
        time.sleep(0.01)
    with stalwart.timer("my_eval"):
        pass
    with timer.section("comm", compute=False):
        pass
    (out,) = timer.resolved()
    assert out["step"] == 5
    assert out["my_eval"] >= 0.01, "sections of one name add up"
    assert [s[0] for s in out["spans"]] == ["data", "my_eval", "my_eval", "comm"]
    starts = [s[1] for s in out["spans"]]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert out["spans"][1][2] >= 10.0, "spans are in ms"
    assert out["wait_s"] == out["comm"]
    assert timer.resolved() == [{"compute_s": 0.0, "wait_s": 0.0}], "an untagged empty step"


def test_timer_without_a_trainer_is_a_no_op_and_checks_its_name():
    runtime.set_section_timer(None)
    with stalwart.timer("anything"):
        pass
    with pytest.raises(ValueError, match="section name"), stalwart.timer(""):
        pass


def test_a_record_is_written_once_both_halves_are_in(tmp_path: Path):
    rec = RankRecords(tmp_path, 3, {"dp": 1, "pp": 0, "tp": 1})
    sections = {"forward": 0.25, "backward": 0.5, "compute_s": 0.25, "wait_s": 0.5, "step": 1}
    sections["spans"] = [["forward", 0.0, 250.0], ["backward", 250.0, 500.0]]
    rec.add_sections(sections)
    rec.add_values(2, {"loss": 2.0, "time": 1.0, "ms": {"step": 800.0}})  # step 2: sections not yet in
    rec.add_values(1, {"loss": 1.0, "time": 0.5, "ms": {"step": 760.0, "checkpoint": 1.5}})
    rec.flush()
    (first,) = [json.loads(line) for line in records_path(tmp_path, 3).read_text().splitlines()]
    assert first["step"] == 1 and first["rank"] == 3 and first["loss"] == 1.0
    assert first["ms"] == {"forward": 250.0, "backward": 500.0, "step": 760.0, "checkpoint": 1.5}
    assert first["compute_ms"] == 250.0 and first["wait_ms"] == 500.0 and len(first["spans"]) == 2
    rec.close()  # a failure or the end: the half-known step 2 is written as it is
    records = list(read_records(tmp_path))
    assert [r["step"] for r in records] == [1, 2] and "spans" not in records[1]
    assert read_meta(tmp_path)[3]["coords"] == {"dp": 1, "pp": 0, "tp": 1}


def test_reading_skips_a_torn_line_and_finds_nested_runs(tmp_path: Path):
    rec = RankRecords(tmp_path / "train", 0, {})
    rec.add_values(1, {"loss": 1.0})
    rec.add_sections({"step": 1, "compute_s": 0.0, "wait_s": 0.0, "spans": []})
    rec.close()
    with open(records_path(tmp_path / "train", 0), "a") as f:
        f.write('{"step": 2, "ra')  # a writer killed mid-line
    assert [r["step"] for r in read_records(tmp_path)] == [1]
    again = RankRecords(tmp_path / "train", 0, {}, append=True)  # a restarted rank appends
    again.add_values(2, {"loss": 2.0})
    again.close()
    assert [r["step"] for r in read_records(tmp_path)] == [1, 2]


def test_a_nested_section_is_shown_but_not_counted_twice(timer: SectionTimer):
    timer.begin_step(1)
    with timer.section("pipeline"):
        start = timer.mark()
        time.sleep(0.01)
        timer.nested("pp_fwd_s0", start, timer.mark())
    (out,) = timer.resolved()
    assert out["pp_fwd_s0"] >= 0.01 and [s[0] for s in out["spans"]] == ["pp_fwd_s0", "pipeline"]
    assert out["compute_s"] == out["pipeline"], "inside the pipeline section: not added to it again"
