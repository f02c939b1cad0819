"""Eviction rules, the node precheck and the node slowdown used to test stragglers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stalwart.chaos import faults
from stalwart.health.precheck import PrecheckConfig, run_precheck
from stalwart.health.throttle import Throttle
from stalwart.launch import eviction
from stalwart.launch.eviction import EvictionPolicy


def nodes(now: float, **members: bool | None) -> list[dict]:
    return [
        {
            "node_id": n,
            "state": "alive",
            "last_heartbeat": now,
            "info": {"min_nodes": 2},
            "progress": {} if m is None else {"member": m},
        }
        for n, m in members.items()
    ]


def test_spares_wait_beside_a_running_round_only():
    now = 1000.0
    assert eviction.spares(nodes(now, a=False, b=False), now) == [], "no round runs: everyone is joining"
    group = nodes(now, a=True, b=True, c=False, d=None)
    assert (eviction.members(group, now), eviction.spares(group, now)) == (["a", "b"], ["c"])
    group[2]["last_heartbeat"] = now - 30  # a silent spare is no spare
    assert eviction.spares(group, now) == []
    group[2]["last_heartbeat"], group[2]["state"] = now, "evicted"
    assert eviction.spares(group, now) == []


def test_a_member_that_regroups_is_no_spare_but_one_left_out_of_the_new_round_is():
    now = 1000.0
    group = nodes(now, a=True, b=False, c=False)
    for n, round_ in zip(group, (4, 4, None)):  # b left round 4 to regroup; c never was a member
        n["progress"]["round"] = round_
    assert eviction.spares(group, now) == ["c"]
    group[0]["progress"]["round"] = 5  # round 5 formed without b: b waits beside it
    assert eviction.spares(group, now) == ["b", "c"]


def test_eviction_keeps_the_minimum_and_judges_precheck_times():
    now = 1000.0
    assert not eviction.keeps_minimum(nodes(now, a=True, b=True), "a", now), "MIN is 2"
    assert eviction.keeps_minimum(nodes(now, a=True, b=True, c=False), "a", now), "the spare makes up"
    assert eviction.precheck_ratio(0.003, [0.001, 0.0012, 0.0009]) == pytest.approx(3.0)
    assert eviction.precheck_ratio(0.003, []) is None
    with pytest.raises(ValueError, match="warn, evict"):
        EvictionPolicy(stragglers="kill")
    with pytest.raises(ValueError, match="--evict-after-failures must be ≥ 0"):
        EvictionPolicy(after_failures=-1)


def test_node_faults_parse_with_their_own_point_and_factor():
    fail, slow, nan = faults.parse("node-fail;slow:at=node:factor=5;nan:at=precheck")
    assert (fail.action, fail.at, fail.node_factor) == ("node-fail", "precheck", faults.NODE_FACTOR)
    assert (slow.action, slow.at, slow.node_factor, slow.once) == ("delay", "node", 5.0, False)
    assert (nan.at, nan.node_factor) == ("precheck", faults.NODE_FACTOR)
    with pytest.raises(AssertionError):
        fail.fire()  # applied by the node check, never fired
    with pytest.raises(ValueError, match="at=node takes slow"):
        faults.parse("kill:at=node")
    with pytest.raises(ValueError, match="node-fail applies at the precheck only"):
        faults.parse("node-fail:at=step")


@pytest.mark.parametrize(
    "spec, ok, reason",
    [
        (None, True, None),
        ("nan:at=precheck", False, "differs from the seeded reference"),
        ("node-fail", False, "burn-in raised RuntimeError"),
    ],
)
def test_precheck_catches_a_bad_device(monkeypatch, tmp_path, spec, ok, reason):
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))
    if spec:
        monkeypatch.setenv(faults.ENV_SPEC, spec)
    else:
        monkeypatch.delenv(faults.ENV_SPEC, raising=False)
    monkeypatch.delenv(faults.ENV_FILE, raising=False)
    faults.reset_cache()
    result = run_precheck(2, PrecheckConfig(matmul_size=128, iters=4))
    assert result.ok is ok and len(result.devices) == 2
    assert result.seconds < 2.0, "cheap enough for every restart"
    assert (reason is None and not result.reasons) or all(reason in r for r in result.reasons), result.reasons
    with pytest.raises(ValueError, match="matmul_size ≥ 8"):
        PrecheckConfig(matmul_size=1)


WORK = """
import time

def median_stretch():
    stretches = []  # wall time per CPU second of a fixed work: contention from other processes cancels out
    for _ in range(15):
        t0, c0 = time.perf_counter(), time.process_time()
        sum(i * i for i in range(400000))  # fixed work, ~10 ms
        stretches.append((time.perf_counter() - t0) / max(time.process_time() - c0, 1e-4))
        time.sleep(0.02)
    return sorted(stretches)[len(stretches) // 2]

free = median_stretch()
print("ready", flush=True)  # the parent throttles from here
time.sleep(0.1)
print(free, median_stretch())
"""


def test_throttle_slows_the_work_not_the_sleep():
    proc = subprocess.Popen([sys.executable, "-c", WORK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    throttle = Throttle(lambda: [proc.pid], factor=10).start()
    try:
        free, slow = map(float, proc.communicate(timeout=60)[0].split())
    finally:
        throttle.close()
    # The same fixed work before and after, in wall seconds per CPU second (a loaded box stretches both
    # alike); the lag of a 2 ms tick keeps it below 10×.
    assert slow > 2.5 * free, (slow, free)
    assert throttle.stopped_s > 0
    with pytest.raises(ValueError, match="factor > 1"):
        Throttle(lambda: [], factor=1.0)
