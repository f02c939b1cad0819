"""Chaos faults read their specs live (the agent sets them in its own process) and fire once per marker dir."""

from __future__ import annotations

import pytest

from stalwart import chaos, runtime
from stalwart.chaos import faults


@pytest.fixture
def chaos_env(tmp_path, monkeypatch):
    monkeypatch.setenv(chaos.ENV_DIR, str(tmp_path / "fired"))
    monkeypatch.delenv(chaos.ENV_SPEC, raising=False)
    monkeypatch.delenv(faults.ENV_FILE, raising=False)
    chaos.reset_cache()
    runtime.reset()
    yield monkeypatch
    chaos.reset_cache()
    runtime.reset()


def test_names_are_the_contracts():
    assert (chaos.ENV_SPEC, chaos.ENV_DIR, faults.ENV_FILE) == (
        runtime.ENV_CHAOS,
        runtime.ENV_CHAOS_DIR,
        runtime.ENV_CHAOS_FILE,
    )


def test_a_spec_set_after_the_contract_was_read_still_fires_once(chaos_env, tmp_path):
    assert runtime.worker_env().chaos == ""  # read before `stalwart run --chaos` sets it in its process
    assert chaos.due("step", step=7, rank=1) is None
    chaos_env.setenv(chaos.ENV_SPEC, "raise:rank=1:step=7")
    assert chaos.due("step", step=7, rank=0) is None and chaos.due("step", step=6, rank=1) is None
    fault = chaos.due("step", step=7, rank=1)
    assert fault is not None and fault.action == "raise"
    assert fault.marker.parent == tmp_path / "fired" and fault.marker.exists()
    assert chaos.due("step", step=7, rank=1) is None, "a once-fault fires once per marker directory"


def test_faults_from_the_injection_file_are_reread_when_it_changes(chaos_env, tmp_path):
    injected = tmp_path / "injected"
    chaos_env.setenv(faults.ENV_FILE, str(injected))
    assert chaos.due("step", step=1, rank=0) is None  # no file yet
    injected.write_text("bogus\nexit:code=3:step=2\n")  # a bad line is skipped, never fatal
    assert chaos.due("step", step=2, rank=0).code == 3


def test_a_fired_fault_stamps_its_time_for_the_agent(chaos_env, tmp_path):
    chaos_env.setenv(runtime.ENV_PROGRESS_DIR, str(tmp_path / "progress"))
    chaos_env.setenv("RANK", "1")
    (tmp_path / "progress").mkdir()
    chaos_env.setenv(chaos.ENV_SPEC, "raise:step=3")
    with pytest.raises(RuntimeError, match="chaos fault"):
        chaos.due("step", step=3, rank=1).fire()
    assert float(runtime.fault_path(tmp_path / "progress", 1).read_text()) > 0


def test_a_slow_factor_stretches_the_section_it_is_in():
    import time

    [slow] = faults.parse("slow:at=forward:rank=1:factor=1.5")
    [stall] = faults.parse("delay:at=forward:seconds=0.01")
    assert slow.stretches and not stall.stretches
    t0 = time.perf_counter()
    slow.stretch(0.04)
    assert time.perf_counter() - t0 >= 0.02, "a 40 ms section made 1.5× as long sleeps ≥ 20 ms"
