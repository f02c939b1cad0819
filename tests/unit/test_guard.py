import math
import random

import pytest

from stalwart.train.guard import GuardSettings, RollbackBudget, RollbackLimitExceeded, SpikeDetector, Verdict


def _decaying_losses(n, seed=0):
    rng = random.Random(seed)
    return [3.0 * math.exp(-i / 200) + 1.0 + rng.gauss(0, 0.02) for i in range(n)]


def test_no_false_alarm_on_a_normal_noisy_curve():
    d = SpikeDetector(GuardSettings(window=50, warmup_steps=20))
    rng = random.Random(1)
    for step, loss in enumerate(_decaying_losses(2000), 1):
        assert d.check(step, loss, grad_norm=abs(rng.gauss(1.0, 0.1))) is None, step


def test_spike_is_caught_on_its_step_and_kept_out_of_the_baseline():
    d = SpikeDetector(GuardSettings(window=30, warmup_steps=10))
    losses = _decaying_losses(100)
    for step, loss in enumerate(losses[:60], 1):
        assert d.check(step, loss, 1.0) is None
    v = d.check(61, losses[60] * 3, 1.0)
    assert v is not None and v.kind == "loss_spike" and v.step == 61 and v.value > v.threshold
    # The spike did not raise the baseline: a second one right after is caught too.
    assert d.check(62, losses[61] * 3, 1.0).kind == "loss_spike"
    assert d.check(63, losses[62], 1.0) is None


def test_nan_inf_and_grad_spike():
    d = SpikeDetector(GuardSettings(window=10, warmup_steps=5))
    assert d.check(1, float("nan")).kind == "nan"
    assert d.check(1, 2.0, float("inf")).kind == "nan"
    for step in range(2, 30):
        assert d.check(step, 2.0 - step * 0.001, 1.0 + 0.01 * (step % 3)) is None
    v = d.check(30, 1.97, 50.0)
    assert v.kind == "grad_spike"


def test_warmup_is_exempt():
    d = SpikeDetector(GuardSettings(window=10, warmup_steps=20))
    for step in range(1, 20):
        assert d.check(step, 10.0 if step % 4 == 0 else 2.0, 1.0) is None


def test_state_roundtrip_and_settings_validation():
    d = SpikeDetector(GuardSettings(window=10, warmup_steps=0))
    for step in range(1, 12):
        d.check(step, 2.0 + 0.01 * step, 1.0)
    e = SpikeDetector(GuardSettings(window=10, warmup_steps=0))
    e.load_state_dict(d.state_dict())
    assert e.check(12, 9.0, 1.0) == d.check(12, 9.0, 1.0)
    with pytest.raises(ValueError, match="window"):
        GuardSettings(window=2)


def test_rollback_budget_stops_with_a_report():
    budget = RollbackBudget(max_rollbacks=2, per_steps=100)

    def roll(verdict, back, skipped):
        budget.check(verdict)  # raises before anything is restored
        return budget.spend(verdict, back, skipped)

    roll(Verdict("loss_spike", 50, 9.0, 3.0), 40, (640, 800))
    roll(Verdict("nan", 120, math.nan, math.nan), 110, (1760, 1920))
    roll(Verdict("loss_spike", 300, 9.0, 3.0), 290, (4640, 4800))  # old ones aged out
    entry = roll(Verdict("grad_spike", 330, 80.0, 5.0), 320, (5120, 5280))
    assert entry == {
        "step": 330,
        "kind": "grad_spike",
        "value": 80.0,
        "threshold": 5.0,
        "rolled_back_to": 320,
        "skipped_samples": [5120, 5280],
    }
    with pytest.raises(RollbackLimitExceeded) as err:
        roll(Verdict("loss_spike", 350, 9.0, 3.0), 340, (5440, 5600))
    message = str(err.value)
    assert "3 rollbacks within 100 steps" in message
    assert "step 300: loss_spike → back to 290, skipped samples 4640..4800" in message
    assert "step 350: loss_spike (not rolled back)" in message and "step 50:" in message
    assert len(budget.history) == 4, "the refused rollback is not recorded"
