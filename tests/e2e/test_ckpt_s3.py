"""s3:// persistence and restore against a local S3-compatible server (moto, started here)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from stalwart.checkpoint.shm import user_dir
from stalwart.utils.ports import free_port

pytestmark = pytest.mark.e2e
pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3_env():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.2)
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": url,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem(anon=False).mkdir("stalwart-test")
    yield env
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    server.send_signal(signal.SIGTERM)
    server.wait(10)


def test_s3_persist_verify_and_restore(s3_env, stdlib_data, tmp_path, capsys):
    url = f"s3://stalwart-test/run-{uuid.uuid4().hex[:6]}"
    shm = Path("/dev/shm") / f"stalwart-s3-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    try:

        def train(steps: int, out: Path) -> dict:
            cmd = [
                sys.executable,
                "-m",
                "stalwart",
                "train",
                "--config",
                "configs/debug.toml",
                "--nproc",
                "1",
                f"--data.dir={stdlib_data}",
                "--data.seq_len=32",
                f"--train.steps={steps}",
                "--train.warmup_steps=2",
                f"--train.out_dir={out}",
                "--checkpoint.enabled=true",
                f"--checkpoint.dir={url}",
                "--checkpoint.persist_every_steps=3",
                f"--checkpoint.shm_dir={shm}",
                "--checkpoint.keeper_idle_s=20",
                "--json",
            ]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
            assert result.returncode == 0, result.stderr[-4000:]
            return json.loads((out / "summary.json").read_text())

        first = train(6, tmp_path / "a")
        import s3fs

        fs = s3fs.S3FileSystem()
        assert fs.cat(f"{url}/latest").decode() == "step-00000006"
        from stalwart.cli import main

        capsys.readouterr()
        assert main(["ckpt", "verify", url, "--step", "6", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]

        # The first job completed, so its memory snapshots are gone: the second restores from S3.
        second = train(8, tmp_path / "b")
        ck = second["checkpoint"]
        assert (ck["restored_from"], ck["restore_step"]) == ("storage", 6), ck
        assert second["samples_consumed"] == 8 * 16 and first["steps"] == 6
        assert fs.cat(f"{url}/latest").decode() == "step-00000008"
    finally:
        for status in user_dir(shm).glob("*/keeper.json"):
            try:
                os.kill(int(json.loads(status.read_text())["pid"]), signal.SIGKILL)
            except (ProcessLookupError, KeyError, ValueError):
                pass
        shutil.rmtree(shm, ignore_errors=True)


class _Endpoint:
    """A TCP forwarder in front of the S3 server that can go away and come back on the same port (while
    down, connections are refused or reset: the endpoint is unreachable; the server keeps its data), and
    can throttle the bytes it forwards to ``rate`` bytes/s (a slow store)."""

    def __init__(self, target_port: int, rate: float = 0.0) -> None:
        self.port = free_port()
        self.target, self.rate = target_port, rate
        self.conns: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
                c.close()
        self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                if self.rate:
                    time.sleep(len(data) / self.rate)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()


STEPS = 48


@contextlib.contextmanager
def _s3_trainer(stdlib_data: Path):
    """Runs `stalwart train` against an S3 URL through an endpoint (``train(url, out, endpoint, *args)``
    → the launcher); kills its keepers and removes its shared memory afterwards."""
    shm = Path("/dev/shm") / f"stalwart-s3f-{uuid.uuid4().hex[:8]}"
    shm.mkdir()

    def train(url: str, out: Path, endpoint: str, *extra: str, chaos: str = "") -> subprocess.Popen:
        cmd = [
            *(sys.executable, "-m", "stalwart", "train", "--config", "configs/debug.toml", "--nproc", "1"),
            *(f"--data.dir={stdlib_data}", "--data.seq_len=32", f"--train.steps={STEPS}", "--train.warmup_steps=2"),
            *(f"--train.out_dir={out}", "--checkpoint.enabled=true", f"--checkpoint.dir={url}"),
            *("--checkpoint.persist_every_steps=3", f"--checkpoint.shm_dir={shm}", "--checkpoint.keeper_idle_s=5"),
            *("--checkpoint.keep_last=100", *extra),
        ]
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "STALWART_CHAOS": chaos}
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    train.shm = shm  # type: ignore[attr-defined]
    try:
        yield train
    finally:
        for status in user_dir(shm).glob("*/keeper.json"):
            try:
                os.kill(int(json.loads(status.read_text())["pid"]), signal.SIGKILL)
            except (ProcessLookupError, KeyError, ValueError):
                pass
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def s3_job(s3_env, stdlib_data):
    with _s3_trainer(stdlib_data) as train:
        yield train


def _finish(job: subprocess.Popen, out: Path) -> tuple[str, dict]:
    text, _ = job.communicate(timeout=300)
    (out.parent / "job.txt").write_text(text)
    assert job.returncode == 0, text[-4000:]
    return text, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference_hashes(s3_env, stdlib_data, tmp_path_factory):
    """A fault-free run's final model and optimizer hashes (straight to the S3 server)."""
    tmp = tmp_path_factory.mktemp("s3ref")
    with _s3_trainer(stdlib_data) as train:
        url = f"s3://stalwart-test/clean-{uuid.uuid4().hex[:6]}"
        _, summary = _finish(train(url, tmp / "a", s3_env["AWS_ENDPOINT_URL"]), tmp / "a")
    return summary["final_hash"], summary["optim_hash"]


def _committed_and_clean(url: str, final: int) -> list[int]:
    from stalwart.checkpoint.storage import Storage

    storage = Storage(url)
    committed = storage.committed()
    assert storage.latest() == final and all(storage.verify(s) == [] for s in committed)
    assert set(storage.steps()) == set(committed), "no torn step directory is left"
    return committed


def test_s3_outage_mid_run_is_survived_and_the_job_ends_bitwise_equal(s3_env, s3_job, reference_hashes, tmp_path):
    """The S3 endpoint goes away mid-run and comes back: training goes on from memory, the outage is a
    `storage` incident (unreachable) on the console and in the keeper's log, no committed checkpoint is
    lost, every commit after it verifies, and the final weights equal a fault-free run's bit for bit."""
    import s3fs

    endpoint = _Endpoint(int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    url = f"s3://stalwart-test/outage-{uuid.uuid4().hex[:6]}"
    fs = s3fs.S3FileSystem()
    try:
        # ≥ 0.4 s a step (≥ 19 s in all): the outage, seen by the keeper seconds after it starts (s3fs
        # retries) and held 3 s more, must land mid-run — on a fast machine the bare job was over by then
        job = s3_job(url, tmp_path / "b", endpoint.url, chaos="slow:seconds=0.4")
        deadline = time.monotonic() + 120
        while not fs.exists(f"{url}/latest") and time.monotonic() < deadline and job.poll() is None:
            fs.invalidate_cache()
            time.sleep(0.1)
        from stalwart.checkpoint.storage import Storage

        before = Storage(url).committed()
        endpoint.down()

        def statuses() -> list[dict]:
            return [json.loads(p.read_text()).get("storage") or {} for p in user_dir(s3_job.shm).glob("*/keeper.json")]

        while not any(s.get("ok") is False for s in statuses()) and time.monotonic() < deadline:
            time.sleep(0.1)
        [failing] = statuses()
        assert failing["cause"] == "unreachable", failing
        # The worker reads the keeper's status at most once a second (at a step): an outage shorter than
        # that may go unsaid on its console (the keeper's log has it). This one lasts: CI saw the keeper
        # fail and recover between two reads once, and the console said neither.
        time.sleep(3)
        endpoint.up()
        out, summary = _finish(job, tmp_path / "b")
    finally:
        endpoint.down()
    assert "storage unreachable" in out and "storage recovered" in out, out[-4000:]
    log = (tmp_path / "b" / "keeper.log").read_text()
    assert "storage unreachable" in log and "storage recovered" in log, log[-4000:]
    committed = _committed_and_clean(url, STEPS)
    assert before and set(before) <= set(committed), "no committed checkpoint was lost"
    assert (summary["final_hash"], summary["optim_hash"]) == reference_hashes


def test_s3_slower_than_the_steps_coalesces_persists_and_commits_the_final_state(
    s3_env, s3_job, reference_hashes, tmp_path
):
    """Throttled storage (each persist takes many steps): training is not held up, due persists are
    coalesced into the newest snapshot, the at-risk bound does not fire on slow-but-working storage, the
    final state is committed and the weights equal a fault-free run's."""
    endpoint = _Endpoint(int(s3_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), rate=4 * 2**20)
    url = f"s3://stalwart-test/slow-{uuid.uuid4().hex[:6]}"
    try:
        out, summary = _finish(
            s3_job(url, tmp_path / "c", endpoint.url, "--checkpoint.max_unpersisted_steps=3"), tmp_path / "c"
        )
    finally:
        endpoint.down()
    log = (tmp_path / "c" / "keeper.log").read_text()
    assert "coalesced" in log, log[-4000:]
    assert not re.search(r"storage (full|permission|unreachable|timeout|torn|error)", out + log), out[-4000:]
    committed = _committed_and_clean(url, STEPS)
    assert len(committed) < STEPS // 3, "slower than the steps: not every due persist could be written"
    assert (summary["final_hash"], summary["optim_hash"]) == reference_hashes
