import math
import multiprocessing as mp
import time

import pytest

from stalwart import runtime
from stalwart.health.log_rules import diagnose, last_traceback
from stalwart.launch.hang import HangDetector, HangPolicy
from stalwart.launch.progress import Progress, ProgressReader
from stalwart.runtime import ProgressWriter, incident


def _hammer(directory, n):
    w = ProgressWriter(directory, 0)
    for step in range(n):
        w.report(step, loss=float(step))


def test_reader_sees_consistent_records_while_another_process_writes(tmp_path):
    ProgressWriter(tmp_path, 0)
    proc = mp.get_context("spawn").Process(target=_hammer, args=(tmp_path, 200_000))
    proc.start()
    reader = ProgressReader(tmp_path)
    seen = 0
    while proc.is_alive():
        p = reader.read(0)
        if p is not None and p.step >= 0:
            assert p.loss == float(p.step), "torn record"  # step and loss are written together
            assert p.reports == p.step + 1, "torn record"  # a zero-filled body would read step 0, loss 0
            seen += 1
    proc.join()
    assert proc.exitcode == 0 and seen > 0
    assert reader.read(0).step == 199_999


def _publish_for(directory, seconds):
    w = ProgressWriter(directory, 0)
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        for _ in range(1000):
            step += 1
            w.report(step, loss=float(step))


def test_sequence_word_never_reads_zero_while_a_writer_publishes(tmp_path):
    """The seqlock's word is one 8-byte store: struct.pack_into would zero-fill it first, and a
    reader catching 0 ("even") twice would accept a half-written record."""
    from stalwart.runtime.progress import seq_view

    ProgressWriter(tmp_path, 0)
    proc = mp.get_context("spawn").Process(target=_publish_for, args=(tmp_path, 1.0))
    proc.start()
    with open(tmp_path / "rank0.progress", "rb") as f:
        import mmap

        m = mmap.mmap(f.fileno(), 64, prot=mmap.PROT_READ)
    seq = seq_view(m)
    reads = zeros = 0
    while proc.is_alive():
        reads += 1
        zeros += seq[0] == 0
    proc.join()
    seq.release()
    m.close()
    assert proc.exitcode == 0 and reads > 0
    assert zeros == 0, f"{zeros} of {reads} reads saw a zero sequence number"


def test_phases_metrics_and_fresh_record(tmp_path):
    w = ProgressWriter(tmp_path, 3)
    r = ProgressReader(tmp_path)
    first = r.read(3)
    assert (first.step, first.phase, first.reports) == (-1, "init", 0) and math.isnan(first.loss)
    w.report(1, loss=2.5, tokens_per_s=100.0)
    assert (r.read(3).step, r.read(3).phase, r.read(3).loss) == (1, "train", 2.5)
    w.set_phase("checkpoint")
    assert r.read(3).phase == "checkpoint"
    with pytest.raises(ValueError, match="unknown phase"):
        w.set_phase("lunch")
    w.flush()
    assert '"tokens_per_s": 100.0' in (tmp_path / "rank3.metrics.jsonl").read_text()
    assert r.read(7) is None


def _p(rank, step, t, reports=10, phase="train"):
    return Progress(rank, step, t, phase, 0.0, reports)


def test_hang_allowance_follows_phase_and_learned_step_time():
    d = HangDetector(HangPolicy(floor_s=10, k=3, startup_s=100, warmup_steps=2, phase_s=500))
    assert d.allowance(_p(0, 0, 0, reports=1)) == 100  # first steps
    for step in range(3, 30):  # 5 s per step
        d.observe(_p(0, step, step * 5.0))
    assert d.median_step_s() == pytest.approx(5.0)
    assert d.allowance(_p(0, 30, 150.0)) == 15.0  # 3 × median beats the 10 s floor
    assert d.allowance(_p(0, 30, 150.0, phase="eval")) == 500
    assert d.hung([_p(0, 29, 145.0), _p(1, 29, 130.0)], now=150.0) == [(1, 20.0, 15.0)]
    assert d.hung([_p(0, 29, 145.0, phase="done")], now=1e9) == []
    fixed = HangDetector(HangPolicy(timeout_s=2.0))
    assert fixed.allowance(_p(0, 5, 0)) == 2.0
    with pytest.raises(ValueError, match="hang-timeout"):
        HangPolicy(timeout_s=0)


# retry: (before any step completed, after progress)
@pytest.mark.parametrize(
    "log, kind, cls, retry",
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", "gpu_xid", "hardware", (True, True)),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "ecc", "hardware", (True, True)),
        ("node1:123 [0] NCCL WARN Call to connect returned Connection refused", "nccl", "system", (True, True)),
        ("[E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout", "nccl", "system", (True, True)),
        (
            "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer",
            "connection",
            "system",
            (True, True),
        ),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom", "user", (False, True)),
        ('  File "train.py", line 3\n    def f(:\nSyntaxError: invalid syntax', "syntax_error", "user", (False, False)),
        ("ModuleNotFoundError: No module named 'foo'", "import_error", "user", (False, False)),
        ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)", "shape_error", "user", (False, True)),
        ("step 100: loss is nan", "nan", "user", (True, True)),
        (
            "stalwart.train.guard.RollbackLimitExceeded: 3 rollbacks within 1000 steps (limit 2)",
            "rollback_limit",
            "user",
            (False, False),
        ),
        (
            "stalwart.train.guard.RollbackUnavailable: non-finite loss at step 1: cannot roll back",
            "rollback_limit",
            "user",
            (False, False),
        ),
        (
            "stalwart.train.guard.SilentDataCorruption: non-finite loss at step 5; rank(s) [1] failed",
            "sdc",
            "hardware",
            (True, True),
        ),
    ],
)
def test_log_rules_classify(log, kind, cls, retry):
    d = diagnose("some normal output\n" + log + "\nmore output")
    assert (d.kind, d.cls, (d.retry(False), d.retry(True))) == (kind, cls, retry)
    assert d.evidence in log


def test_clean_log_has_no_diagnosis_and_traceback_extraction():
    assert diagnose("step 1 loss 2.0\nstep 2 loss 1.9\n") is None
    log = (
        'noise\nTraceback (most recent call last):\n  File "a.py", line 1, in <module>\n    boom()\n'
        "ZeroDivisionError: division by zero\nafter\n"
    )
    assert last_traceback(log).splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert last_traceback("nothing here") is None


def test_straggler_needs_k_consecutive_slow_windows():
    from stalwart.launch.stragglers import StragglerDetector

    d = StragglerDetector(threshold=1.3, k=3)
    t = 1000.0
    assert d.observe("a", 1.0, t) == (False, None)  # no peers yet
    flags = []
    for w in range(6):
        t += 5
        d.observe("a", 1.0, t)
        d.observe("b", 1.05, t)
        slow = 2.0 if w != 2 else 1.0  # one normal window resets the count
        flags.append(d.observe("c", slow, t)[0])
    assert flags == [False, False, False, False, False, True]
    assert d.flagged == {"c"}
    d.observe("c", 1.0, t + 5)
    assert d.flagged == set(), "a recovered node is no longer flagged"
    assert d.observe("b", 1.0, t + 500)[1] is None, "stale peers are ignored"


def test_section_timer_separates_compute_and_wait():
    from stalwart.observe.timers import SectionTimer

    timer = SectionTimer()
    with timer.section("forward"):
        time.sleep(0.02)
    with timer.section("comm", compute=False):
        time.sleep(0.01)
    with timer.section("forward"):
        time.sleep(0.01)
    out = timer.step_done()
    assert out["forward"] >= 0.03 and out["comm"] >= 0.01
    assert out["compute_s"] == out["forward"] and out["wait_s"] == out["comm"]
    assert timer.step_done() == {"compute_s": 0.0, "wait_s": 0.0}


def test_progress_carries_compute_time(tmp_path):
    w = ProgressWriter(tmp_path, 0)
    w.report(3, loss=1.0, compute_s=0.25)
    assert ProgressReader(tmp_path).read(0).compute_s == 0.25


@pytest.fixture
def fresh_runtime():
    """The contract is read once per process: forget it before and after a test that changes it."""
    runtime.reset()
    yield
    runtime.reset()


def test_incident_appends_one_json_line_per_call_for_the_agent(tmp_path, monkeypatch, fresh_runtime):
    import json

    import stalwart

    monkeypatch.delenv("STALWART_PROGRESS_DIR", raising=False)
    runtime.reset()
    assert stalwart.incident("rollback", step=3) is False
    monkeypatch.setenv("STALWART_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    runtime.reset()  # the contract is read once per process; a forked worker resets it
    assert stalwart.incident is incident
    assert incident("rollback", step=12, verdict="nan", value=float("nan"), skipped_samples=[32, 48])
    assert incident("sdc", "hardware", step=12, evict=True, rank=2)
    lines = (tmp_path / "rank2.incidents.jsonl").read_text().splitlines()
    first, second = (json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) for line in lines)
    assert set(first) == {"time", "rank", "kind", "class", "step", "detail"}
    assert (first["rank"], first["kind"], first["class"], first["step"]) == (2, "rollback", "training", 12)
    assert first["detail"] == {"verdict": "nan", "value": "nan", "skipped_samples": [32, 48]}
    assert (second["kind"], second["class"], second["detail"]) == ("sdc", "hardware", {"evict": True, "rank": 2})
