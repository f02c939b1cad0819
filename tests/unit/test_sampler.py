import functools
import operator
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data import GlobalSampler
from stalwart.data.sampler import parse_skip_ranges


def _run(num_samples, global_batch, seed, segments):
    """Train through `segments` [(world_size, steps), ...]: every rank owns a sampler, and at each
    world-size change fresh samplers resume from the previous state_dict. Returns every
    (epoch, sample) seen and the final state."""
    seen, state = [], None
    for world, steps in segments:
        samplers = [GlobalSampler(num_samples, global_batch, seed) for _ in range(world)]
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
        for _ in range(steps):
            starts = [s.rank_slice(r, world)[0] for r, s in enumerate(samplers)]
            batches = [s.next_batch(r, world) for r, s in enumerate(samplers)]
            assert sum(len(b) for b in batches) == global_batch
            for lo, ids in zip(starts, batches):
                seen.extend(((lo + j) // num_samples, int(i)) for j, i in enumerate(ids))
        assert len({s.consumed for s in samplers}) == 1, "ranks disagree on the position"
        state = samplers[0].state_dict()
    return seen, state


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 60),
    global_batch=st.integers(1, 24),
    seed=st.integers(0, 2**31),
    segments=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12)), min_size=1, max_size=5),
)
def test_every_sample_of_every_epoch_exactly_once(num_samples, global_batch, seed, segments):
    seen, state = _run(num_samples, global_batch, seed, segments)
    counts = Counter(seen)
    assert all(c == 1 for c in counts.values()), "a sample was repeated within an epoch"
    consumed = state["consumed"] if state else 0
    full_epochs = consumed // num_samples
    for epoch in range(full_epochs):
        assert {i for e, i in counts if e == epoch} == set(range(num_samples)), f"epoch {epoch} incomplete"
    # The partial epoch is a prefix of that epoch's order: nothing skipped.
    tail = [i for e, i in seen if e == full_epochs]
    order = GlobalSampler(num_samples, global_batch, seed).epoch_order(full_epochs)
    assert sorted(tail) == sorted(order[: consumed - full_epochs * num_samples].tolist())


@settings(max_examples=50, deadline=None)
@given(worlds=st.lists(st.integers(1, 8), min_size=2, max_size=4), steps=st.integers(1, 10))
def test_global_stream_is_independent_of_world_size(worlds, steps):
    streams = []
    for world in worlds:
        sampler = GlobalSampler(37, 12, seed=5)
        stream = []
        for _ in range(steps):
            stream.extend(
                np.concatenate([sampler.samples_at(*sampler.rank_slice(r, world)) for r in range(world)]).tolist()
            )
            sampler.consumed += 12
        streams.append(stream)
    assert all(s == streams[0] for s in streams)


def test_next_batch_skip_and_order():
    s = GlobalSampler(10, 4, seed=0)
    a = s.next_batch(0, 2)
    assert len(a) == 2 and s.consumed == 4 and s.steps_done == 1
    assert s.skip(3) == (4, 16) and s.epoch == 1
    assert not np.array_equal(s.epoch_order(0), s.epoch_order(1)), "epochs should reshuffle"
    assert np.array_equal(GlobalSampler(10, 4, shuffle=False).epoch_order(3), np.arange(10))
    assert np.array_equal(s.epoch_order(1), GlobalSampler(10, 4, seed=0).epoch_order(1))


def test_state_mismatch_is_explained():
    state = GlobalSampler(10, 4, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_samples=10.*num_samples=11"):
        GlobalSampler(11, 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="negative"):
        GlobalSampler(10, 4).skip(-1)
    with pytest.raises(ValueError, match="outside world"):
        GlobalSampler(10, 4).rank_slice(2, 2)


def _stream(sampler, steps):
    return [sampler.next_batch(0, 1).tolist() for _ in range(steps)]


def test_configured_skip_range_equals_a_rollback_skip():
    configured = GlobalSampler(50, 4, seed=3, skip=[(8, 16)])
    rolled = GlobalSampler(50, 4, seed=3)
    head = _stream(rolled, 2)
    assert rolled.skip(2) == (8, 16)
    assert head + _stream(rolled, 10) == _stream(configured, 12)
    plain = GlobalSampler(50, 4, seed=3).samples_at(0, 56).tolist()
    assert (
        functools.reduce(operator.iadd, _stream(GlobalSampler(50, 4, seed=3, skip=[(8, 16)]), 12), [])
        == plain[:8] + plain[16:]
    )
    ranks = [GlobalSampler(50, 4, seed=3, skip=[(6, 10)]) for _ in range(3)]  # ranks' slices of a batch
    for batch in _stream(GlobalSampler(50, 4, seed=3, skip=[(6, 10)]), 5):
        assert np.concatenate([s.next_batch(r, 3) for r, s in enumerate(ranks)]).tolist() == batch


def test_unaligned_ranges_are_never_served_and_skips_accumulate_across_loads():
    s = GlobalSampler(100, 4, shuffle=False, skip=[(6, 10), (12, 13)])
    assert [b.tolist() for b in (s.next_batch(0, 1), s.next_batch(0, 1))] == [[0, 1, 2, 3], [4, 5, 10, 11]]
    assert s.next_batch(0, 1).tolist() == [13, 14, 15, 16]
    before = GlobalSampler(100, 4, shuffle=False).state_dict()  # a checkpoint taken before a skip
    t = GlobalSampler(100, 4, shuffle=False)
    assert t.skip(1) == (0, 4)
    t.load_state_dict(before)  # a rollback to that checkpoint keeps the skip ...
    assert t.consumed == 0 and t.skip_ranges == [(0, 4)]
    assert t.skip(1) == (0, 8)  # ... and a further skip extends past it
    assert t.next_batch(0, 1).tolist() == [8, 9, 10, 11]
    u = GlobalSampler(100, 4, shuffle=False)
    u.load_state_dict(t.state_dict())  # a restart restores them from the checkpoint
    assert u.skip_ranges == [(0, 8)] and t.state_dict()["skip"] == "0:8"


def test_parse_skip_ranges():
    assert parse_skip_ranges("") == []
    assert parse_skip_ranges("32:48, 8:16,40:64") == [(8, 16), (32, 64)]
    for bad in ("5", "a:b", "4:4", "-1:3"):
        with pytest.raises(ValueError, match="START:STOP"):
            parse_skip_ranges(bad)
