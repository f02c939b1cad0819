"""Falcon's pipeline scatter-gather under PP2×TP2 (4 gloo processes, the debug model, 3 steps): a stage
sends only its 1/tp sequence slice (the default) versus the whole activation (``pp_scatter_gather =
false``), both in one job on the same batches. Same losses and gradient norms (the arithmetic is the
same: the whole activation is gathered, then each rank keeps its own slice; tolerance 1e-6 relative),
and exactly half the bytes posted to isend on every rank; the scatter-gather run also follows a 1-process
plain-PyTorch run (1e-4, as tests/e2e/test_parallel.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent / "scripts" / "pp_scatter_gather.py"


def test_scatter_gather_sends_half_with_the_same_losses(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    proc = subprocess.run([*cmd, str(SCRIPT), f"--out={out}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    sg, plain = runs["scatter_gather"], runs["plain"]
    assert sg["losses"] == pytest.approx(runs["reference"]["losses"], rel=1e-4), "PP×TP vs 1 process"
    assert sg["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert sg["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-6)
    # every rank sends (stage 0: activations forward, stage 1: their gradients backward), tp = 2× less
    for (f_sg, b_sg), (f_plain, b_plain) in zip(sg["sent"], plain["sent"], strict=True):
        assert f_sg + b_sg > 0
        assert (f_plain, b_plain) == (2 * f_sg, 2 * b_sg)
