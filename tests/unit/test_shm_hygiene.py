"""Shared memory per user and job: snapshots hold the model's weights, so a job's directory is
``<shm root>/stalwart-<uid>/<job>`` (0700, ours), files are 0600, symlinks are never followed and a
directory owned by someone else is refused with an error that says what to do."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from stalwart.checkpoint import NodeJob, job_dir_for
from stalwart.checkpoint.keeper_link import spawn_keeper
from stalwart.checkpoint.shm import ShmPermissionError, atomic_write, secure_job_dir, user_dir

OTHER_UID = 54321  # no such user needed: chown takes any id
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a directory to another uid")


@pytest.fixture
def shm():
    """A sticky, world-writable root in the real tmpfs, like /dev/shm itself."""
    root = Path("/dev/shm") / f"stalwart-hyg-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_job_directory_is_per_user_private_and_files_are_0600(shm):
    old = os.umask(0)  # the most permissive umask: privacy must not depend on it
    try:
        job = NodeJob(job_dir_for("file:///ck", shm, job_id="j1"))
        os.close(job.attach())
        job.paths.rank_dir(0).mkdir()
        atomic_write(job.paths.owner(0), b"{}")
    finally:
        os.umask(old)
    assert job.root == shm / f"stalwart-{os.geteuid()}" / "j1" == user_dir(shm) / "j1"
    assert mode(job.root.parent) == 0o700 and mode(job.root) == 0o700
    assert os.stat(job.root.parent).st_uid == os.geteuid()
    assert mode(job.paths.owner(0)) == 0o600
    assert mode(job.paths.job_lock) == 0o600


def test_an_existing_directory_open_to_others_is_narrowed(shm):
    mine = user_dir(shm)
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    secure_job_dir(mine / "j")
    assert mode(mine) == 0o700 and mode(mine / "j") == 0o700


@as_root
def test_a_user_directory_owned_by_someone_else_is_refused(shm):
    mine = user_dir(shm)
    mine.mkdir(mode=0o700)
    os.chown(mine, OTHER_UID, OTHER_UID)
    with pytest.raises(ShmPermissionError, match=rf"belongs to uid {OTHER_UID}, not to you .*checkpoint.shm_dir"):
        NodeJob(mine / "j").attach()
    assert not (mine / "j").exists()


@as_root
def test_a_job_directory_owned_by_someone_else_is_refused(shm):
    secure_job_dir(user_dir(shm) / "j")
    os.chown(user_dir(shm) / "j", OTHER_UID, OTHER_UID)
    with pytest.raises(ShmPermissionError, match=f"belongs to uid {OTHER_UID}"):
        spawn_keeper(NodeJob(user_dir(shm) / "j"), None)


def test_a_planted_symlink_is_not_followed(shm, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    user_dir(shm).symlink_to(target)
    with pytest.raises(ShmPermissionError, match="is a symlink; refusing to follow it"):
        NodeJob(user_dir(shm) / "j").attach()
    assert list(target.iterdir()) == []  # nothing was written through the link
    secure_job_dir(shm / "mine" / "j")
    (shm / "mine" / "j" / "k").symlink_to(target)
    with pytest.raises(ShmPermissionError, match="is a symlink"):
        secure_job_dir(shm / "mine" / "j" / "k")


def test_a_file_planted_in_place_of_the_directory_is_refused(shm):
    user_dir(shm).write_bytes(b"")
    with pytest.raises(ShmPermissionError, match="is not a directory"):
        secure_job_dir(user_dir(shm) / "j")


def test_atomic_write_does_not_write_through_a_symlink_at_its_temporary_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "owner.json"
    # A stale temporary name (a dead process's pid came back) that someone turned into a link.
    (tmp_path / f".owner.json.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(victim)
    atomic_write(path, b"new")
    assert victim.read_bytes() == b"keep" and path.read_bytes() == b"new" and mode(path) == 0o600


@as_root
def test_a_shm_root_owned_by_another_user_and_not_sticky_is_refused(shm):
    os.chmod(shm, 0o755)
    os.chown(shm, OTHER_UID, OTHER_UID)
    with pytest.raises(ShmPermissionError, match=f"shm root {shm} belongs to uid {OTHER_UID}"):
        secure_job_dir(user_dir(shm) / "j")
    os.chown(shm, 0, 0)
    os.chmod(shm, 0o777)  # root's but anyone may rename entries in it
    with pytest.raises(ShmPermissionError, match="world-writable without the sticky bit"):
        secure_job_dir(user_dir(shm) / "j")


@as_root
def test_two_users_on_one_host_get_their_own_directories_and_cannot_read_each_other(shm):
    """Root's job runs first; a second user's job on the same host is neither blocked nor able to read
    root's snapshot files (a real process switched to another uid)."""
    job = NodeJob(job_dir_for("file:///ck", shm, job_id="j"))
    os.close(job.attach())
    job.paths.rank_dir(0).mkdir()
    atomic_write(job.paths.slot(0, 0, "obj"), b"weights")
    code = (
        "import os, sys; from stalwart.checkpoint import NodeJob, job_dir_for\n"
        f"os.setgid({OTHER_UID}); os.setuid({OTHER_UID})\n"
        f"job = NodeJob(job_dir_for('file:///ck', {str(shm)!r}, job_id='j')); os.close(job.attach())\n"
        "print(job.root)\n"
        f"try:\n    open({str(job.paths.slot(0, 0, 'obj'))!r}, 'rb').read(); print('READ')\n"
        "except PermissionError:\n    print('DENIED')\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": src}
    )
    if "Permission denied" in out.stderr and "stalwart" not in out.stdout:
        pytest.skip(f"uid {OTHER_UID} cannot read the interpreter or the sources here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr
    theirs, verdict = out.stdout.split()
    assert Path(theirs) == shm / f"stalwart-{OTHER_UID}" / "j" and os.stat(theirs).st_uid == OTHER_UID
    assert verdict == "DENIED"
