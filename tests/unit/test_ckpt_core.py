"""Flash checkpoint building blocks in one process: chaos specs, state capture/apply, shm slots,
the optimizer pre-step hook, and the /dev/shm space check."""

from __future__ import annotations

import copy
import random
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from stalwart import chaos
from stalwart.checkpoint.shm import JobPaths, complete_slots
from stalwart.checkpoint.snapshot import SnapshotView, SnapshotWriter
from stalwart.checkpoint.state import TrainingState
from stalwart.config import load_config
from stalwart.utils import state_dict_hash


@pytest.fixture
def shm(tmp_path):
    """A job directory in /dev/shm (the real tmpfs), removed afterwards."""
    root = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    yield JobPaths(root)
    shutil.rmtree(root, ignore_errors=True)


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def step(model, opt, sched=None) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if sched:
        sched.step()


# -- chaos --------------------------------------------------------------------------------------------
def test_chaos_parse_and_errors():
    kill, delay = chaos.parse("kill:rank=1:step=7:at=copy; delay:seconds=0.5:at=persist")
    assert (kill.action, kill.rank, kill.step, kill.at, kill.once) == ("kill", 1, 7, "copy", True)
    assert (delay.action, delay.seconds, delay.at, delay.once) == ("delay", 0.5, "persist", False)
    assert kill.matches("copy", 7, 1) and not kill.matches("copy", 7, 0) and not kill.matches("step", 7, 1)
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        chaos.parse("explode:rank=1")
    with pytest.raises(ValueError, match="key=value"):
        chaos.parse("kill:when=3")
    with pytest.raises(ValueError, match="step expects a number"):
        chaos.parse("kill:step=x")


def test_chaos_fires_once_across_processes(monkeypatch, tmp_path):
    monkeypatch.setenv(chaos.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(chaos.ENV_SPEC, "raise:rank=0:step=3")
    chaos.reset_cache()
    assert chaos.due("step", step=2, rank=0) is None
    assert chaos.due("step", step=3, rank=1) is None
    fault = chaos.due("step", step=3, rank=0)
    assert fault is not None and fault.marker.exists()  # a restarted process sees the marker
    with pytest.raises(RuntimeError, match="chaos fault"):
        fault.fire()
    chaos.reset_cache()
    assert chaos.due("step", step=3, rank=0) is None
    monkeypatch.delenv(chaos.ENV_SPEC)
    assert chaos.due("step", step=3, rank=0) is None


# -- state ------------------------------------------------------------------------------------------------
def test_state_roundtrip_restores_model_optimizer_scheduler_rng_and_extras():
    model, opt, sched = tiny()
    extras = {"tokens": 7}
    for _ in range(2):
        step(model, opt, sched)
    ts = TrainingState({"model": model, "optim": opt, "scheduler": sched, "extra": extras}, rank=0)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    saved = copy.deepcopy(ts.state_dict())  # what a checkpoint holds
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    ref_model, ref_opt = state_dict_hash(model.state_dict()), state_dict_hash(opt.state_dict())
    step(model, opt, sched)  # move everything on
    extras["tokens"] = 99
    ts.load(saved)
    assert state_dict_hash(model.state_dict()) == ref_model and state_dict_hash(opt.state_dict()) == ref_opt
    assert sched.last_epoch == 2 and extras == {"tokens": 7}
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


def test_state_rejects_mistakes():
    model, opt, _ = tiny()
    with pytest.raises(ValueError, match="non-empty dict"):
        TrainingState({}, 0)
    with pytest.raises(ValueError, match="reserved"):
        TrainingState({"rng": {}}, 0)
    with pytest.raises(ValueError, match="is a int"):
        TrainingState({"model": model, "steps": 3}, 0)
    with pytest.raises(ValueError, match="no nn.Module"):
        TrainingState({"optim": opt}, 0)


def test_capture_before_first_step_leaves_optimizer_untouched():
    model, opt, _ = tiny()
    before = state_dict_hash(model.state_dict())
    captured = TrainingState({"model": model, "optim": opt}, 0).capture()
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert state_dict_hash(model.state_dict()) == before
    assert not any(k.startswith("optim.state") for k in captured.tensors)


def test_optimizer_state_is_keyed_per_parameter_and_the_cache_reads_fresh_hyperparameters(shm):
    """A snapshot keeps each optimizer's param groups compact (hyperparameters + parameter FQNs); the
    checkpoint view spells them out under DCP's flattened keys (per parameter: pipeline stages, which
    hold different parameters, never collide) and its nested keys (torch's default template), exactly
    as DCP gives them. The capture cache, which reuses DCP's state across steps, still reports the
    scheduler's current lr."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from stalwart._compat import flatten_state_dict
    from stalwart.checkpoint.state import FLAT_OPTIM

    model, opt, sched = tiny()
    ts = TrainingState({"model": model, "optim": opt}, 0, rng=False)
    step(model, opt, sched)
    first = ts.capture()
    step(model, opt, sched)  # lr changes; AdamW updates its state tensors in place (a cache hit)
    second = ts.capture()
    assert second.signature == first.signature and second.tensors is not first.tensors
    names = [n for n, _ in model.named_parameters()]
    assert not any(k.startswith("optim.") for k in second.objects)
    assert [g["params"] for g in second.groups["optim"]] == [names]
    assert {k for k in second.tensors if k.startswith("optim.")} == {
        f"optim.state.{n}.{s}" for n in names for s in ("step", "exp_avg", "exp_avg_sq")
    }
    lr = second.groups["optim"][0]["lr"]
    assert lr == opt.param_groups[0]["lr"] == pytest.approx(first.groups["optim"][0]["lr"] * 2 / 3)
    w = SnapshotWriter(shm, 0, 1)
    w.start(2, second, persist=False)
    w.wait()
    with SnapshotView(shm, complete_slots(shm, 0)[0]) as view:
        objects, mappings = view.objects, view.mappings
    w.close()
    for options in (FLAT_OPTIM, None):  # exactly what DCP gives (and takes) in both layouts
        fresh, paths = flatten_state_dict({"optim": get_optimizer_state_dict(model, opt, options=options)})
        for key, value in fresh.items():
            if isinstance(value, torch.Tensor):
                assert key in second.tensors and mappings[key][0] == "optim"
            else:
                assert objects[key] == value and mappings[key] == paths[key], key
    assert objects[f"optim.param_groups.{names[0]}.lr"] == lr


def test_a_checkpoint_without_per_parameter_hyperparameters_is_refused_with_the_reason():
    model, opt, _ = tiny()
    step(model, opt)
    ts = TrainingState({"model": model, "optim": opt}, 0, rng=False)
    nested = ts.state_dict(for_load=True)
    nested["optim"] = {k: v for k, v in nested["optim"].items() if not k.startswith("param_groups.")}
    with pytest.raises(ValueError, match="predates the flattened optimizer state"):
        ts.load(nested)


def test_a_checkpoint_with_packed_hyperparameters_is_refused_with_the_reason():
    """The previous layout packed one parameter's hyperparameters into one item
    (``optim.param_groups.<fqn>`` = ((name, value), ...)); a restore from such a checkpoint prunes the
    per-parameter keys it lacks from the template, and the load then names the reason."""
    from stalwart._compat import flatten_state_dict
    from stalwart.checkpoint.restore import _prune_missing

    model, opt, _ = tiny()
    step(model, opt)
    ts = TrainingState({"model": model, "optim": opt}, 0, rng=False)
    nested = ts.state_dict(for_load=True)
    flat, _ = flatten_state_dict(nested)
    packed = {f"optim.param_groups.{n}" for n, _ in model.named_parameters()}
    present = {k for k in flat if not k.startswith("optim.param_groups.")} | packed
    assert _prune_missing(nested, present, 0)
    with pytest.raises(ValueError, match="predates the flattened optimizer state or packs them"):
        ts.load(nested)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of checkpoint.memory_every"):
        load_config(None, {"checkpoint.memory_every": "3", "checkpoint.persist_every_steps": "5"}).validate()
    with pytest.raises(ValueError, match="checkpoint.keep_last must be ≥ 1"):
        load_config(None, {"checkpoint.keep_last": "0"}).validate()
    with pytest.raises(ValueError, match="unknown config key 'checkpoint.every'"):
        load_config(None, {"checkpoint.every": "3"})


# -- snapshots ------------------------------------------------------------------------------------------
def test_double_buffer_alternates_slots_and_generations(shm):
    model, opt, _ = tiny()
    ts = TrainingState({"model": model, "optim": opt}, 0)
    w = SnapshotWriter(shm, 0, 1)
    hashes = {}
    for s in (1, 2, 3):
        step(model, opt)
        hashes[s] = state_dict_hash(model.state_dict())
        assert w.start(s, ts.capture(), persist=s == 3)
        w.wait()
    slots = complete_slots(shm, 0)
    assert [x.step for x in slots] == [3, 2] and slots[0].generation == slots[1].generation + 1
    assert slots[0].header["persist"] and not slots[1].header["persist"]
    with SnapshotView(shm, slots[1]) as view:  # the older slot is intact and complete
        assert view.step == 2
        fresh, _, _ = tiny(seed=1)
        fresh.load_state_dict({k[len("model.") :]: view.tensor(k) for k in view.entries if k.startswith("model.")})
        assert state_dict_hash(fresh.state_dict()) == hashes[2]
    w.close()


def test_a_header_reencodes_its_tables_only_when_they_change_and_reads_as_before(shm):
    """The entry table and mappings are encoded once per layout and reused; the header still parses to
    the same fields and follows a change (an extra's new key: new mappings under the same tensors)."""
    model, opt, _ = tiny()
    extras = {"seen": 1}
    ts = TrainingState({"model": model, "optim": opt, "extras": extras}, 0)
    w = SnapshotWriter(shm, 0, 1)
    headers = []
    for s in (1, 2, 3):
        step(model, opt)
        if s == 3:
            extras["tokens"] = 12
        captured = ts.capture()
        assert w.start(s, captured, persist=False)
        w.wait()
        headers.append((complete_slots(shm, 0)[0].header, captured))
        if s == 1:
            first_encoding = w._encoded[2]
        if s == 2:
            assert w._encoded[2] is first_encoding, "the same tables: reused, not encoded again"
    for header, captured in headers:
        assert header["mappings"] == {k: list(v) for k, v in captured.mappings.items()}
        assert [e["key"] for e in header["entries"]] == list(captured.sources)
    assert headers[0][0]["step"] == 1 and headers[2][0]["step"] == 3 and headers[2][0]["generation"] == 3
    assert "extras.tokens" in headers[2][0]["mappings"] and "extras.tokens" not in headers[1][0]["mappings"]
    with SnapshotView(shm, complete_slots(shm, 0)[0]) as view:
        assert view.objects["extras.tokens"] == 12
    w.close()


def test_pinned_slot_is_not_overwritten_and_both_busy_skips(shm):
    model, opt, _ = tiny()
    ts = TrainingState({"model": model, "optim": opt}, 0)
    w = SnapshotWriter(shm, 0, 1)
    for s in (1, 2):
        step(model, opt)
        w.start(s, ts.capture(), False)
        w.wait()
    older = complete_slots(shm, 0)[1]
    with SnapshotView(shm, older):  # the keeper persists step 1: its slot must survive
        for s in (3, 4):
            step(model, opt)
            assert w.start(s, ts.capture(), False)
            w.wait()
        assert sorted(x.step for x in complete_slots(shm, 0)) == [1, 4]
        with SnapshotView(shm, complete_slots(shm, 0)[0]):
            assert not w.start(5, ts.capture(), False)  # both pinned: skipped, training goes on
    assert w.stats["skipped"] == 1
    w.close()


def test_pre_step_hook_keeps_snapshot_consistent(shm, monkeypatch, tmp_path):
    """A copy slowed down mid-way must still capture the parameters of the step it was taken at."""
    monkeypatch.setenv(chaos.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(chaos.ENV_SPEC, "delay:seconds=0.5:at=copy")
    chaos.reset_cache()
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ts = TrainingState({"model": model, "optim": opt}, 0, rng=False)
    w = SnapshotWriter(shm, 0, 1)
    hook = opt.register_step_pre_hook(lambda *_: w.wait_copied())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    at_save = state_dict_hash(model.state_dict())
    w.start(1, ts.capture(), False)
    opt.step()  # mutates every parameter; the hook holds it until the copy is done
    assert state_dict_hash(model.state_dict()) != at_save
    hook_wait = w.stats["wait_s"]
    w.wait()
    assert w.stats["wait_s"] == hook_wait and w.stats["end_wait_s"] > 0, "the final wait is not the hook's"
    with SnapshotView(shm, complete_slots(shm, 0)[0]) as view:
        snap = {k[len("model.") :]: view.tensor(k).clone() for k in view.entries if k.startswith("model.")}
    assert state_dict_hash(snap) == at_save
    assert w.stats["wait_s"] > 0
    hook.remove()
    w.close()


def test_shm_space_is_checked_up_front(shm, monkeypatch):
    import stalwart.checkpoint.snapshot as snapshot

    monkeypatch.setattr(snapshot, "shm_free_bytes", lambda path: 1024)
    model, opt, _ = tiny()
    step(model, opt)
    w = SnapshotWriter(shm, 0, 1)
    with pytest.raises(ValueError, match=r"need .* MiB in .* only 0.0 MiB are free; enlarge /dev/shm"):
        w.start(1, TrainingState({"model": model, "optim": opt}, 0).capture(), False)
    w.close()


def test_capture_reuses_dcp_state_dicts_but_always_shows_current_values():
    """capture() caches DCP's name walk; what it returns must equal a fresh capture at every step,
    also after a load replaced the optimizer's state tensors."""
    model, opt, sched = tiny()
    step(model, opt, sched)
    cached = TrainingState({"model": model, "optim": opt, "sched": sched}, 0)
    cached.capture()

    def same_as_fresh() -> bool:
        a = cached.capture()
        b = TrainingState({"model": model, "optim": opt, "sched": sched}, 0).capture()
        return (
            a.tensors.keys() == b.tensors.keys()
            and a.objects == b.objects
            and a.mappings == b.mappings
            and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
        )

    for _ in range(3):
        step(model, opt, sched)
        assert same_as_fresh()
    saved = cached.capture()
    snapshot = {k: v.clone() for k, v in saved.tensors.items()}
    step(model, opt, sched)
    nested = cached.state_dict(for_load=True)
    from stalwart.checkpoint.state import set_path

    for key, path in saved.mappings.items():
        if key in snapshot:
            set_path(nested, path, snapshot[key])
    cached.load(nested)  # the optimizer gets new state tensors: the cache must notice
    after = cached.capture()
    assert all(torch.equal(after.tensors[k], snapshot[k]) for k in snapshot)
    step(model, opt, sched)
    assert same_as_fresh()


def test_the_model_cache_notices_a_replaced_submodule_parameter_or_data():
    """The cached model part is checked against each module's own children, parameters and buffers
    (not a fresh walk of the whole model): every way of replacing a tensor shows in the next capture."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2))
    state = TrainingState({"model": model}, 0, rng=False)

    def captured() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in state.capture().tensors.items()}

    def fresh() -> dict[str, torch.Tensor]:
        return TrainingState({"model": model}, 0, rng=False).capture().tensors

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)

    captured()
    model[0][0] = nn.Linear(4, 4)  # a grandchild replaced: only its parent's children change
    assert same(captured(), fresh())
    model[1].weight = nn.Parameter(torch.full((2, 4), 7.0))  # a parameter replaced
    assert same(captured(), fresh())
    model[1].weight.data = torch.zeros(2, 4)  # the same Parameter, new data
    assert same(captured(), fresh())
    model[0][1].running_mean = torch.ones(4)  # a buffer replaced
    assert same(captured(), fresh())
    model[0].append(nn.Linear(4, 4))  # a new child with new keys
    after = captured()
    assert same(after, fresh()) and "model.0.2.weight" in after


def test_rng_states_converted_once_still_follow_every_draw():
    """numpy's and Python's states are converted to tensors again only when they changed: a state
    taken after draws differs, and each restores its own sequence."""
    from stalwart.checkpoint.state import rng_state, set_rng_state

    first = rng_state()
    assert rng_state()["python_state"] is first["python_state"], "unchanged: converted once"
    draws = (random.random(), np.random.rand())
    second = rng_state()
    assert not torch.equal(first["python_state"], second["python_state"])
    assert not torch.equal(first["numpy_keys"], second["numpy_keys"]) or first["numpy_pos"] != second["numpy_pos"]
    more = (random.random(), np.random.rand())
    set_rng_state(first)
    assert (random.random(), np.random.rand()) == draws
    set_rng_state(second)
    assert (random.random(), np.random.rand()) == more


def test_a_load_template_never_shares_the_rng_tensors_a_capture_holds():
    """A restore writes the loaded states into its template: were those the tensors the cache hands
    to captures, a later capture at the cached state would save the loaded one instead."""
    model, opt, _ = tiny()
    state = TrainingState({"model": model, "optim": opt}, 0)
    random.seed(1)
    at_o = state.capture().tensors["rng.rank0.python_state"].clone()
    template = state.state_dict(for_load=True)["rng"]["rank0"]
    random.seed(2)
    loaded = torch.tensor(random.getstate()[1], dtype=torch.int64)
    template["python_state"].copy_(loaded)  # what a restore does: the loaded state, into the template
    random.seed(1)  # back to the cached state (a rollback replays the same draws)
    again = state.capture().tensors["rng.rank0.python_state"]
    assert torch.equal(again, at_o) and not torch.equal(again, loaded)


def test_ranks_of_a_job_directory_that_another_process_removes_meanwhile(tmp_path):
    """The last rank out of a memory-only job removes the job directory while another rank may be
    listing it (CI: FileNotFoundError from a listing of a vanishing directory killed a finished rank)."""
    paths = JobPaths(tmp_path / "job")
    assert paths.ranks() == []
    (tmp_path / "job").write_text("not a directory")
    assert paths.ranks() == []
    (tmp_path / "job").unlink()
    stop = threading.Event()

    def churn() -> None:  # the other rank: create and remove the directory as fast as it can
        while not stop.is_set():
            for r in range(50):
                (tmp_path / "job" / f"rank{r}").mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp_path / "job", ignore_errors=True)

    thread = threading.Thread(target=churn)
    thread.start()
    seen: list[list[int]] = []
    deadline = time.monotonic() + 30
    try:  # until the listing saw the directory both present and gone, many times over
        while (len(seen) < 2000 or all(seen) or not any(seen)) and time.monotonic() < deadline:
            seen.append(paths.ranks())
    finally:
        stop.set()
        thread.join()
    assert all(r == sorted(r) and set(r) <= set(range(50)) for r in seen)
    assert any(seen) and not all(seen), "the listing saw the directory both present and gone"
