"""Hang diagnosis from synthetic Flight Recorder dumps: desync fingerprints, silent ranks."""

from __future__ import annotations

from stalwart.observe.hangdiag import diagnose

GROUPS = {"5": {"label": "dp", "ranks": [0, 1]}}


def _dump(rank: int, ops: list[tuple[str, list, bool]]) -> dict:
    entries = [
        {"process_group": ["5", "undefined"], "collective_seq_id": i, "profiling_name": op, "input_sizes": sizes}
        | {"input_dtypes": ["Float"], "retired": done, "is_p2p": False}
        for i, (op, sizes, done) in enumerate(ops, 1)
    ]
    return {"rank": rank, "coords": {"dp": rank}, "groups": GROUPS, "fr": {"entries": entries}}


def test_a_shape_mismatch_is_a_desync_with_both_fingerprints():
    dumps = {
        0: _dump(0, [("gloo:all_reduce", [[8]], True), ("gloo:all_reduce", [[8]], False)]),
        1: _dump(1, [("gloo:all_reduce", [[8]], True), ("gloo:all_reduce", [[4]], False)]),
    }
    diag = diagnose(dumps, expected=[0, 1])
    [desync] = diag["desync"]
    assert desync["group"] == "dp" and desync["seq"] == 2
    assert desync["fingerprints"][0]["sizes"] == [[8]] and desync["fingerprints"][1]["sizes"] == [[4]]
    assert "desync in group dp at collective #2" in diag["summary"]
    [stuck] = diag["stuck"]
    assert stuck["waiting"] == [0, 1] and stuck["missing"] == []


def test_a_rank_without_a_dump_is_named():
    dumps = {0: _dump(0, [("gloo:broadcast", [[2]], True), ("gloo:broadcast", [[2]], False)])}
    diag = diagnose(dumps, expected=[0, 1])
    assert diag["no_dump"] == [1]
    [stuck] = diag["stuck"]
    assert stuck["seq"] == 2 and stuck["op"] == "gloo:broadcast" and stuck["waiting"] == [0]
    assert [(m["rank"], m["where"]) for m in stuck["missing"]] == [(1, "no dump")]


def test_nothing_pending_is_no_hang_in_collectives():
    diag = diagnose({r: _dump(r, [("gloo:all_reduce", [[8]], True)]) for r in (0, 1)}, expected=[0, 1])
    assert diag["stuck"] == [] and diag["desync"] == [] and "no collective is pending" in diag["summary"]


def test_the_agent_waits_for_nobody_without_dumpers_and_asks_those_that_run_one(tmp_path):
    import json
    import threading

    from stalwart.observe import flight
    from stalwart.observe.hangdiag import hang_collectives

    assert hang_collectives(tmp_path, [0, 1], timeout_s=60)["summary"] == "no flight-recorder dumper in these ranks"
    flight.ready_path(tmp_path, 1).write_text("1")

    def answer():  # rank 1's dumper, answering the request as its thread would
        while not flight.request_path(tmp_path, 1).exists():
            threading.Event().wait(0.05)
        body = _dump(1, [("gloo:all_reduce", [[8]], False)]) | {"time": 9e99}
        flight.dump_path(tmp_path, 1).write_text(json.dumps(body))

    threading.Thread(target=answer, daemon=True).start()
    diag = hang_collectives(tmp_path, [0, 1], timeout_s=60)
    assert diag["no_dump"] == [] and diag["stuck"][0]["waiting"] == [1], "rank 0 (no dumper) was not waited for"
