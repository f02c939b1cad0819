"""`stalwart check` on 4 simulated nodes (4 real processes, gloo): exactly the bad node is named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stalwart.health.check import Fault, isolation_pairs, isolation_turns, neighbour_pairs, round1_suspects

pytestmark = pytest.mark.e2e


def check(*args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "check", "--nodes", "4", "--json", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "fault, bad, slow",
    [
        (None, [], []),
        ("nan:node=2", [2], []),
        ("node-fail:node=1", [1], []),
        ("slow:node=3:factor=3", [], [3]),
        ("burst:node=3:factor=3", [], []),
    ],
)
def test_check_names_exactly_the_bad_node(fault, bad, slow):
    code, report = check(*(["--fault", fault] if fault else []))
    timings = [
        {k: n[k] for k in ("node", "matmul_s", "round1_pair", "round1_s", "round2_pair", "round2_s", "reasons")}
        for n in report["nodes"]
    ]
    assert (report["bad_nodes"], report["stragglers"]) == (bad, slow), json.dumps(timings)  # a str: never cut
    assert code == (0 if not bad and not slow else 1)
    if fault and fault.startswith("burst"):
        # slow in rounds 1 and 2 (a load burst), so only the retime beside a healthy pair cleared it
        node3, healthy = report["nodes"][3], report["nodes"][0]
        assert node3["round2_s"] > 2 * healthy["round1_s"], timings
    if fault and fault.startswith("node-fail"):
        # Round 1 suspected the partner too; round 2 cleared it.
        partner = report["nodes"][0]
        assert partner["round1_ok"] is False and partner["round2_ok"] is True and partner["ok"]


def test_pairing_rules():
    assert neighbour_pairs(4) == [(0, 1), (2, 3)]
    assert neighbour_pairs(5) == [(0, 1), (2, 3)]  # node 4 waits for round 2
    speed = {0: 1.0, 1: 1.0, 2: 9.0, 3: 9.5, 4: 0.5}
    assert isolation_pairs([2, 3], [0, 1, 4], speed) == [(3, 4), (2, 0)]
    assert isolation_pairs([2, 3], [], speed) == []
    # one healthy node (node 2's matmul is corrupt, pair 0-1 was slow): it isolates both suspects in turn
    assert isolation_turns([0, 1], [3], {0: 5.0, 1: 4.0, 3: 1.0}) == [[(0, 3)], [(1, 3)]]
    assert isolation_turns([2, 3], [0, 1, 4], speed) == [[(3, 4), (2, 0)]]
    assert isolation_turns([2, 3], [], speed) == []
    # 4 nodes: 2 pairs, one 20x slower; a mean-of-two median would be half its time and miss it
    assert round1_suspects({(0, 1): True, (2, 3): True}, {(0, 1): 1.5, (2, 3): 32.0}, 2.0) == {(2, 3)}
    assert round1_suspects({(0, 1): True, (2, 3): True}, {(0, 1): 1.5, (2, 3): 2.5}, 2.0) == set()
    ok3, s3 = {(0, 1): True, (2, 3): True, (4, 5): False}, {(0, 1): 1.0, (2, 3): 1.2, (4, 5): 9.0}
    assert round1_suspects(ok3, s3, 2.0) == {(4, 5)}, "a wrong sum is a suspect, and its timing is no reference"
    assert Fault.parse("slow:node=2:factor=4") == Fault("slow", 2, 4.0)
    with pytest.raises(ValueError, match="unknown check fault"):
        Fault.parse("melt:node=1")
    with pytest.raises(ValueError, match="KIND:node=N"):
        Fault.parse("nan")
