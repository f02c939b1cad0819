"""Warm start: workers forked by the zygote behave like `python ARGS` to the launcher — exit codes,
signals, stdio, environment — die with their stand-in, and fall back to a cold start when the zygote
cannot run them faithfully. Real processes throughout (the zygote preloads a small module, not torch,
to keep these tests fast)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stalwart.launch.zygote import Zygote
from stalwart.launch.zygote_worker import parse_python_args

SCRIPT = """
import os, signal, sys, time
import zyg_probe
print("out", os.environ.get("PROBE"), sys.argv[1:], os.getcwd(), os.getppid(), zyg_probe.VERSION, flush=True)
print("err", file=sys.stderr, flush=True)
what = sys.argv[1]
if what == "exit":
    sys.exit(3)
if what == "raise":
    raise RuntimeError("boom in the worker")
if what == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
if what == "graceful":
    signal.signal(signal.SIGTERM, lambda *_: (open("graceful.txt", "w").write("saved"), sys.exit(7)))
    open("handler-ready", "w").close()
if what == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open("handler-ready", "w").close()
if what == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
if what in ("graceful", "sleep", "stubborn"):
    time.sleep(60)
"""


@pytest.fixture()
def zygote(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "zyg_probe.py").write_text("VERSION = 1\n")
    monkeypatch.setenv("PYTHONPATH", f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    (tmp_path / "job.py").write_text(SCRIPT)
    z = Zygote(["zyg_probe"], tmp_path / "z")
    z.ensure()
    assert z.socket.exists(), "the zygote is listening"
    yield z
    z.stop()
    assert z.proc.poll() is not None


def start(z: Zygote, tmp_path: Path, what: str, *python_args: str, **env_vars: str) -> subprocess.Popen:
    exe, args = z.entrypoint([*python_args, "-u", str(tmp_path / "job.py"), what])
    env = {**os.environ, **z.env(), "PROBE": "p1", **env_vars}
    return subprocess.Popen(
        [exe, *args],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=open(tmp_path / f"{what}.out", "w"),
        stderr=open(tmp_path / f"{what}.err", "w"),
    )


def output(tmp_path: Path, what: str) -> tuple[str, str]:
    return (tmp_path / f"{what}.out").read_text(), (tmp_path / f"{what}.err").read_text()


def worker_of(z: Zygote, client: subprocess.Popen, timeout: float = 30) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while z.worker_pid(client.pid) == client.pid:
        assert time.monotonic() < deadline and client.poll() is None, "the worker was not forked"
        time.sleep(0.02)
    return psutil.Process(z.worker_pid(client.pid))


def test_a_forked_worker_runs_like_python_with_its_stdio_env_and_exit_code(zygote, tmp_path):
    p = start(zygote, tmp_path, "ok")
    assert p.wait(60) == 0
    out, err = output(tmp_path, "ok")
    fields = out.split()
    assert fields[:4] == ["out", "p1", "['ok']", str(tmp_path)] and fields[-1] == "1", out
    assert int(fields[4]) == zygote.proc.pid, "forked by the zygote, not started cold"
    assert err == "err\n"
    assert start(zygote, tmp_path, "exit").wait(30) == 3


def test_an_uncaught_exception_prints_the_scripts_traceback_and_exits_1(zygote, tmp_path):
    assert start(zygote, tmp_path, "raise").wait(30) == 1
    _, err = output(tmp_path, "raise")
    assert "RuntimeError: boom in the worker" in err and 'job.py", line' in err
    assert "zygote" not in err and "runpy" not in err, "the launcher's own frames are hidden"


def test_death_by_signal_is_reported_as_the_same_signal(zygote, tmp_path):
    assert start(zygote, tmp_path, "segv").wait(30) == -signal.SIGSEGV


def test_sigterm_reaches_the_workers_own_handler(zygote, tmp_path):
    p = start(zygote, tmp_path, "graceful")
    worker_of(zygote, p)
    deadline = time.monotonic() + 30
    while not (tmp_path / "handler-ready").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGTERM)  # what TorchElastic does to stop a worker
    assert p.wait(30) == 7
    assert (tmp_path / "graceful.txt").read_text() == "saved"


def test_a_worker_that_outlives_its_stop_signal_is_named_with_its_state(zygote, tmp_path):
    """TorchElastic waits up to 30 s for a stopped worker, then kills it: the wait is said, not silent
    (CI17: a node's agent sat ≥ 12 s in its preemption with nothing in the log)."""
    p = start(zygote, tmp_path, "stubborn")
    w = worker_of(zygote, p)
    deadline = time.monotonic() + 30
    while not (tmp_path / "handler-ready").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGTERM)
    said = f"worker {w.pid} not ended 5 s after a stop signal (state S; no word from the zygote)"
    while said not in output(tmp_path, "stubborn")[1]:
        assert time.monotonic() < deadline and p.poll() is None, output(tmp_path, "stubborn")
        time.sleep(0.1)
    w.kill()
    assert p.wait(30) == -signal.SIGKILL


def test_a_stopped_worker_dies_on_sigterm_and_a_killed_client_takes_its_worker_along(zygote, tmp_path):
    stopped = start(zygote, tmp_path, "stop")
    w = worker_of(zygote, stopped)
    deadline = time.monotonic() + 30
    while w.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(stopped.pid, signal.SIGTERM)
    assert stopped.wait(30) == -signal.SIGTERM
    sleeper = start(zygote, tmp_path, "sleep")
    w = worker_of(zygote, sleeper)
    sleeper.kill()  # SIGKILL: the stand-in cannot forward anything
    sleeper.wait()
    psutil.wait_procs([w], timeout=10)
    assert not w.is_running() or w.status() == psutil.STATUS_ZOMBIE


def test_what_the_zygote_cannot_mimic_starts_cold(zygote, tmp_path):
    # An interpreter flag it does not handle: exec'd as `python -X dev ...` instead.
    p = start(zygote, tmp_path, "ok", "-X", "dev")
    assert p.wait(60) == 0
    out, err = output(tmp_path, "ok")
    assert "starting cold" in err and int(out.split()[4]) != zygote.proc.pid
    # Another PYTHONPATH than the zygote started with: its sys.path would be the zygote's, so cold.
    p = start(zygote, tmp_path, "ok", PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ['PYTHONPATH']}")
    assert p.wait(60) == 0
    out, err = output(tmp_path, "ok")
    assert "PYTHONPATH is not the zygote's" in err and int(out.split()[4]) != zygote.proc.pid
    # Preloaded code changed on disk: cold start, the zygote exits, ensure() starts a fresh one that
    # has the new code.
    probe = tmp_path / "lib" / "zyg_probe.py"
    probe.write_text("VERSION = 2\n")
    os.utime(probe, (time.time() + 5, time.time() + 5))
    old = zygote.proc
    assert start(zygote, tmp_path, "ok").wait(60) == 0
    out, err = output(tmp_path, "ok")
    assert "changed since the zygote loaded it" in err and out.split()[-1] == "2"
    assert old.wait(10) is not None
    zygote.ensure()
    assert zygote.proc is not old
    assert start(zygote, tmp_path, "ok").wait(60) == 0
    out, _ = output(tmp_path, "ok")
    assert int(out.split()[4]) == zygote.proc.pid and out.split()[-1] == "2"


def test_no_zygote_means_a_cold_start(zygote, tmp_path):
    zygote.stop()
    p = start(zygote, tmp_path, "exit")
    assert p.wait(60) == 3
    assert "starting cold" in output(tmp_path, "exit")[1]


def test_python_arguments_are_parsed_like_the_interpreter():
    assert parse_python_args(["-u", "-m", "stalwart", "train", "-x"]) == (True, "stalwart", None, ["train", "-x"])
    assert parse_python_args(["s.py", "-u"]) == (False, None, "s.py", ["-u"])
    for bad in (["-X", "dev", "s.py"], ["-u"], []):
        with pytest.raises(ValueError):
            parse_python_args(bad)


def test_a_forked_worker_reads_its_own_contract_not_the_zygotes(tmp_path, monkeypatch):
    """A preloaded module read the worker contract in the zygote (lazily, once); the worker must see
    its own environment's values (runtime.reset in the forked child)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "zyg_contract.py").write_text(
        "from stalwart import runtime\nfrom stalwart.runtime import progress\n"
        "ZYGOTE_NODE = runtime.worker_env().node_id\nprogress.writer()\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("STALWART_NODE_ID", "zygote-node")
    monkeypatch.delenv("STALWART_PROGRESS_DIR", raising=False)
    (tmp_path / "job.py").write_text(
        "import os, zyg_contract\nfrom stalwart import runtime\nfrom stalwart.runtime import progress\n"
        "print(zyg_contract.ZYGOTE_NODE, runtime.worker_env().node_id, progress.writer() is not None, os.getppid())\n"
    )
    z = Zygote(["zyg_contract"], tmp_path / "z")
    z.ensure()
    try:
        exe, args = z.entrypoint(["-u", str(tmp_path / "job.py")])
        env = {
            **os.environ,
            **z.env(),
            "STALWART_NODE_ID": "worker-node",
            "STALWART_PROGRESS_DIR": str(tmp_path / "progress"),
            "RANK": "0",
        }
        out = subprocess.run(
            [exe, *args], check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        zygote_node, node, has_writer, parent = out.stdout.split()
        assert int(parent) == z.proc.pid, "forked by the zygote, not started cold"
        assert (zygote_node, node) == ("zygote-node", "worker-node")
        assert has_writer == "True", "the progress writer follows the worker's STALWART_PROGRESS_DIR"
    finally:
        z.stop()


def test_a_workers_death_reaches_its_client_while_the_zygote_cannot_answer(zygote, tmp_path):
    """The zygote imports its idle-time preloads in its only thread (seconds, e.g. dynamo) and cannot
    report a worker's exit meanwhile; the client reads it from the zombie's /proc record instead, so
    TorchElastic sees a failed worker at once, not a silent one that looks hung. Here the zygote is
    stopped outright after the fork: nothing but /proc can tell the client."""
    (tmp_path / "dies.py").write_text(
        "import os, signal, sys, time\n"
        "time.sleep(1.0)\n"
        "if sys.argv[1] == 'kill':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "sys.exit(5)\n"
    )
    for what, expected in (("exit", 5), ("kill", -signal.SIGKILL)):
        exe, args = zygote.entrypoint(["-u", str(tmp_path / "dies.py"), what])
        client = subprocess.Popen([exe, *args], env={**os.environ, **zygote.env()}, cwd=tmp_path)
        worker_of(zygote, client)
        os.kill(zygote.proc.pid, signal.SIGSTOP)
        try:
            assert client.wait(timeout=30) == expected
        finally:
            os.kill(zygote.proc.pid, signal.SIGCONT)


def test_the_stalwart_preload_covers_the_models_construction_on_meta():
    """A restarted `stalwart train` worker builds its model on the meta device; nn.init.normal_ there goes
    through torch._refs, which imports dynamo (0.4-0.7 s of the demo's 0.86 s restart start): the zygote's
    preload for `-m stalwart` leaves the worker nothing of torch to import for it."""
    code = """
import importlib, sys
from stalwart.launch.zygote import preload_for
for name in preload_for(["-m", "stalwart", "train"]):
    importlib.import_module(name)
import torch
from stalwart.models.registry import build_model, model_args
before = set(sys.modules)
with torch.device("meta"):
    build_model("debug", model_args("debug", vocab_size=256))
print(sorted(m for m in set(sys.modules) - before if m.startswith("torch")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout[:2000]
