"""s3:// persistence and restore against a local S3-compatible server (moto, started here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from stalwart.checkpoint.shm import user_dir

pytestmark = pytest.mark.e2e
pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
