"""The worker ↔ agent contract reads every variable once, typed, and only when asked."""

from __future__ import annotations

import time

import pytest

from stalwart import runtime


def test_defaults_without_a_launcher() -> None:
    env = runtime.WorkerEnv.from_environ({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (0, 1, 0, 1)
    assert not env.launched and not env.under_agent and not env.parent_reports


def test_reads_torchrun_and_stalwart_variables() -> None:
    env = runtime.WorkerEnv.from_environ(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "TORCHELASTIC_RESTART_COUNT": "2",
            runtime.ENV_PROGRESS_DIR: "/p",
            runtime.ENV_JOB_ID: "j",
            runtime.ENV_NODE_ID: "n",
            runtime.ENV_CHAOS: "kill:rank=1:step=2",
            runtime.ENV_PARENT_REPORTS: "1",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.group_rank) == (3, 4, 1, 2, 1)
    assert env.restart_count == 2 and runtime.WorkerEnv.from_environ({}).restart_count == 0
    assert env.epoch == 2, "without the agent's epoch: TorchElastic's restart count"
    assert runtime.WorkerEnv.from_environ({runtime.ENV_EPOCH: "7", "TORCHELASTIC_RESTART_COUNT": "2"}).epoch == 7
    assert env.launched and env.under_agent and env.parent_reports
    assert (env.progress_dir, env.job_id, env.node_id, env.chaos) == ("/p", "j", "n", "kill:rank=1:step=2")


def test_bad_integer_names_the_variable() -> None:
    with pytest.raises(ValueError, match="RANK='x'"):
        runtime.WorkerEnv.from_environ({"RANK": "x", "WORLD_SIZE": "2"})


def test_read_lazily_once_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.reset()
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert runtime.worker_env().rank == 5
    monkeypatch.setenv("RANK", "6")
    assert runtime.worker_env().rank == 5  # read once: the contract does not change under a running worker
    runtime.reset()
    assert runtime.worker_env().rank == 6
    runtime.reset()


@pytest.fixture
def fresh_runtime():
    runtime.reset()
    yield
    runtime.reset()


def test_writer_reads_directory_and_rank_from_the_contract_until_reset(tmp_path, monkeypatch, fresh_runtime) -> None:
    from stalwart.launch.progress import ProgressReader

    monkeypatch.delenv(runtime.ENV_PROGRESS_DIR, raising=False)
    runtime.report(1, loss=0.5)  # no agent: a no-op
    assert runtime.writer() is None
    monkeypatch.setenv(runtime.ENV_PROGRESS_DIR, str(tmp_path / "a"))
    monkeypatch.setenv("RANK", "3")
    assert runtime.writer() is None, "read once: a running worker's contract does not change"
    runtime.reset()  # what the zygote's forked child does before running the worker
    runtime.report(7, loss=0.25)
    with runtime.phase("eval"):
        seen = ProgressReader(tmp_path / "a").read(3)
        assert (seen.step, seen.loss, seen.phase) == (7, 0.25, "eval")
    runtime.finished()
    assert ProgressReader(tmp_path / "a").read(3).phase == "done"
    assert runtime.record_path(tmp_path / "a", 3).exists()
    runtime.fault_fired(123.5)
    assert float(runtime.fault_path(tmp_path / "a", 3).read_text()) == 123.5


def test_chaos_variables_are_read_live(monkeypatch, fresh_runtime) -> None:
    monkeypatch.setenv(runtime.ENV_CHAOS, "kill:step=1")
    monkeypatch.delenv(runtime.ENV_CHAOS_FILE, raising=False)
    assert runtime.worker_env().chaos == "kill:step=1"
    monkeypatch.setenv(runtime.ENV_CHAOS, "kill:step=2")  # e.g. `stalwart run --chaos` in the agent's process
    monkeypatch.setenv(runtime.ENV_CHAOS_DIR, "/markers")
    assert runtime.chaos_now() == ("kill:step=2", "")
    assert runtime.chaos_marker_dir() == "/markers"


def test_import_stalwart_is_stdlib_only_and_reads_nothing() -> None:
    import subprocess
    import sys

    code = (
        "import sys, stalwart, stalwart.runtime as r; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'rich')); "
        "assert not bad, bad; assert r.env._current is None and not r.progress._resolved; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_runtime_imports_nothing_of_stalwart_outside_itself() -> None:
    import ast
    from pathlib import Path

    for path in Path(runtime.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith("stalwart") or name.startswith("stalwart.runtime"), (path.name, name)


def test_every_stalwart_variable_is_named_in_the_contract() -> None:
    import ast
    import re
    from pathlib import Path

    named = {getattr(runtime, n) for n in runtime.__all__ if n.startswith("ENV_")}
    src = Path(runtime.__file__).parents[1]
    used = {
        (path.relative_to(src).as_posix(), node.value)
        for path in src.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"STALWART_[A-Z_]+", node.value)
    }
    assert {value for _, value in used} <= named, sorted(u for u in used if u[1] not in named)


def test_die_with_parent_kills_the_child_when_its_parent_exits(tmp_path) -> None:
    """A grandchild armed with die_with_parent dies with the intermediate process that forked it."""
    import os
    import subprocess
    import sys
    import time

    code = (
        "import os, sys, time\n"
        "from stalwart import runtime\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    assert runtime.die_with_parent(os.getppid())\n"
        f"    open({str(tmp_path / 'armed')!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while not (tmp_path / "armed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "armed").read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, 9)
    raise AssertionError("the child outlived its parent")


def test_exit_process_ends_as_the_interpreter_would_but_does_not_finalize(tmp_path) -> None:
    """Non-daemon threads joined, atexit run, buffered output flushed, the exit code kept; but no
    interpreter finalization: an object that speaks only when finalization collects it stays silent."""
    import subprocess
    import sys

    code = (
        "import atexit, sys, threading, time\n"
        "from stalwart import runtime\n"
        "class Finalized:\n"
        f"    def __del__(self, _open=open): _open({str(tmp_path / 'finalized')!r}, 'w').write('x')\n"
        "keep = Finalized()\n"
        "done = []\n"
        "t = threading.Thread(target=lambda: (time.sleep(0.2), done.append(1)))\nt.start()\n"
        "atexit.register(lambda: print('atexit saw', done, end=''))\n"
        "sys.stdout.write('buffered ')\n"
        "runtime.exit_process(3)\n"
        "print('unreachable')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "buffered atexit saw [1]", out.stdout
    assert not (tmp_path / "finalized").exists()
    # the same object does speak when the interpreter finalizes (the check above can fail)
    plain = subprocess.run([sys.executable, "-c", code.replace("runtime.exit_process(3)\n", "")], timeout=60)
    assert plain.returncode == 0 and (tmp_path / "finalized").exists()


def _run_exit(tmp_path, body: str, grace: str = "30", timeout: float = 60):
    """Run ``body`` then ``runtime.exit_process(0)`` as a worker under an agent (a progress record)."""
    import os
    import subprocess
    import sys

    code = "import threading, time\nfrom concurrent.futures import ThreadPoolExecutor\nfrom stalwart import runtime\n"
    code += "runtime.report(1)\n" + body + "\nruntime.exit_process(0)\n"
    env = {**os.environ, "STALWART_PROGRESS_DIR": str(tmp_path), "RANK": "1", "STALWART_EXIT_GRACE_S": grace}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    return out, time.monotonic() - t0


def test_exit_process_stops_an_open_executor_first_as_the_interpreter_does(tmp_path) -> None:
    """An executor never shut down (its idle worker waits for work): threading's exit hooks stop it
    before the join, so the process ends at once (joining first never ended: seen with nanoGPT), and
    the progress record says the script returned — finished, not hung."""
    from stalwart.launch.progress import ProgressReader

    out, took = _run_exit(tmp_path, "pool = ThreadPoolExecutor(2)\npool.submit(time.sleep, 0.01).result()")
    assert out.returncode == 0, out.stderr
    assert took < 20 and "did not" not in out.stderr, (took, out.stderr)
    assert ProgressReader(tmp_path).read(1).phase == "returned"


def test_a_thread_that_never_ends_is_named_with_its_stack_and_ended_after_the_grace(tmp_path) -> None:
    out, took = _run_exit(
        tmp_path,
        "def wait_forever():\n    threading.Event().wait()\n"
        "threading.Thread(target=wait_forever, name='never-ends').start()",
        grace="1",
    )
    assert out.returncode == 0, out.stderr  # the script's own code: its work is done
    assert 1 <= took < 20, took
    assert "rank 1: the script ended (exit code 0) 1 s ago" in out.stderr and "'never-ends'" in out.stderr, out.stderr
    assert "in wait_forever" in out.stderr, "the stuck thread's stack"


def test_a_failed_script_keeps_its_exit_code_and_is_not_marked_returned(tmp_path) -> None:
    import subprocess
    import sys

    from stalwart.launch.progress import ProgressReader

    code = "from stalwart import runtime\nruntime.report(1)\nruntime.exit_process(7)\n"
    env = {**__import__("os").environ, "STALWART_PROGRESS_DIR": str(tmp_path), "RANK": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 7, out.stderr
    assert ProgressReader(tmp_path).read(0).phase == "train"


def test_a_cold_started_worker_bounds_the_interpreters_own_exit_too(tmp_path) -> None:
    """No exit_process (``--warm-start off``): the hook threading runs before its join marks the record
    and arms the same watchdog."""
    import os
    import subprocess
    import sys

    from stalwart.launch.progress import ProgressReader

    code = (
        "import threading\nfrom stalwart import runtime\nruntime.report(1)\n"
        "threading.Thread(target=threading.Event().wait, name='never-ends').start()\n"
    )
    env = {**os.environ, "STALWART_PROGRESS_DIR": str(tmp_path), "RANK": "0", "STALWART_EXIT_GRACE_S": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "'never-ends'" in out.stderr, out.stderr
    assert ProgressReader(tmp_path).read(0).phase == "returned"


def test_exit_grace_must_be_a_positive_number() -> None:
    from stalwart.runtime import WorkerEnv

    assert WorkerEnv.from_environ({"STALWART_EXIT_GRACE_S": "2.5"}).exit_grace_s == 2.5
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ValueError, match="STALWART_EXIT_GRACE_S"):
            WorkerEnv.from_environ({"STALWART_EXIT_GRACE_S": bad})


def test_a_forked_child_ending_does_not_mark_its_parent_returned(tmp_path) -> None:
    """A DataLoader worker (a fork) runs threading's exit hooks at its end, ours included: it must not
    write "returned" into its parent's record (the parent trains on; the agent would skip its hangs)."""
    out, _ = _run_exit(
        tmp_path,
        "import multiprocessing as mp\nfrom stalwart.launch.progress import ProgressReader\n"
        "child = mp.get_context('fork').Process(target=int)\nchild.start()\nchild.join()\n"
        f"print(ProgressReader({str(tmp_path)!r}).read(1).phase, child.exitcode)",
    )
    assert out.returncode == 0 and out.stdout.split() == ["train", "0"], (out.stdout, out.stderr)


def test_die_with_parent_says_why_it_exits_when_the_parent_is_already_gone() -> None:
    """Armed too late (its parent gone already), the process exits 1 and says so: an empty log and exit
    code 1 read as an unexplained worker failure."""
    import subprocess
    import sys

    code = (
        "import os\nfrom stalwart import runtime\nruntime.die_with_parent(os.getppid() + 999_999)\nprint('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "survived" not in proc.stdout, (proc.returncode, proc.stdout)
    assert "parent process" in proc.stderr and "is gone" in proc.stderr, proc.stderr
