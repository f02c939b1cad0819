"""Falcon's pipeline scatter-gather under PP2×TP2 (4 gloo processes, the debug model): a stage sends only
its 1/tp sequence slice (the default) versus the whole activation (``pp_scatter_gather = false``).
Same losses and gradient norms (the arithmetic is the same: the whole activation is gathered, then each
rank keeps its own slice; tolerance 1e-6 relative), and exactly half the bytes posted to isend per TP rank."""

from __future__ import annotations

import pytest

from tests.e2e.test_parallel import harness

pytestmark = pytest.mark.e2e
ARGS = ("--layout=pp=2,tp=2", "--schedule=1f1b", "--steps=4", "--global-batch=8", "--micro-batch=2")


def test_scatter_gather_sends_half_with_the_same_losses(stdlib_data, tmp_path):
    sg = harness(tmp_path / "sg.json", stdlib_data, *ARGS, nproc=4)
    plain = harness(tmp_path / "plain.json", stdlib_data, *ARGS, "--no-pp-scatter-gather", nproc=4)
    assert sg["layout"]["pp"] == 2 and sg["layout"]["tp"] == 2
    for a, b in zip(sg["losses"], plain["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    for a, b in zip(sg["grad_norms"], plain["grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    # every rank sends something (stage 0: activations, stage 1: gradients), tp = 2 times less of it
    for (f_sg, b_sg), (f_plain, b_plain) in zip(sg["pp_sent_bytes"], plain["pp_sent_bytes"], strict=True):
        assert f_sg + b_sg > 0
        assert (f_plain, b_plain) == (2 * f_sg, 2 * b_sg)
