"""Warm start: a per-node fork server ("zygote") with torch imported, so a restart skips the cold start.

Recovery time is dominated by a restarted worker's cold start (interpreter, ~2000 modules of torch and
the training stack), not by detection or respawn. The agent starts one zygote per node; it imports
torch, starts waiting on a Unix socket, and imports the rest of ``preload`` (the training stack) while
idle. TorchElastic starts ``zygote_client.py`` in place of ``python ARGS``; the client passes its
stdio, environment, cwd and ARGS, and the zygote forks a child that becomes the worker: own session,
the client's fds, the worker's environment, then ``runpy`` of the script or module as ``python ARGS``
would run it.

Correctness rules:
  - only a single-threaded zygote forks (native library pools with fork handlers, e.g. OpenBLAS, are
    fine; Python threads are not), and it never touches CUDA — the worker initializes its devices;
  - the zygote refuses (the client then starts cold) anything it cannot run as ``python`` would:
    interpreter flags other than ``-u``, a ``PYTHONPATH`` other than its own, or a preloaded module
    whose source changed on disk since the preload (it then exits, and the agent starts a fresh one for
    the next restart);
  - a worker dies with its client (SIGKILL when the client's socket closes) and with the zygote
    (PR_SET_PDEATHSIG), and the zygote dies with the agent, so no worker outlives its launcher.
Environment variables read only at import time (e.g. OMP/MKL thread settings) come from the agent's
environment; ``OMP_NUM_THREADS`` is applied again in the worker with ``torch.set_num_threads``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart import _compat, runtime
from stalwart.launch import zygote_client
from stalwart.launch.zygote_worker import become_worker, parse_python_args

log = logging.getLogger("stalwart.zygote")
CLIENT = Path(zygote_client.__file__)
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.checkpoint")
# `-m stalwart`: the trainer (first: what a stalwart worker needs before anything else).
STALWART_PRELOAD = ("stalwart.cli", "stalwart.commands.train", "stalwart.train.trainer")
MAX_REQUEST = 16 << 20


def preload_for(cmd_args: list[str]) -> list[str]:
    """Modules worth importing ahead for this worker command: torch's training stack, stalwart's trainer
    when the worker is ``-m stalwart``, then dynamo for every worker: scripts' torch.compile and others
    import it (0.5-3 s), and so does the trainer's model init on the meta device (nn.init.normal_
    through torch._refs: 0.4-0.7 s of a restart's start on the CPU)."""
    return [*DEFAULT_PRELOAD, *(STALWART_PRELOAD if runs_stalwart(cmd_args) else ()), *_compat.DYNAMO_MODULES]


def runs_stalwart(cmd_args: list[str]) -> bool:
    """The worker command is ``python -m stalwart ...`` (the trainer), not a user's script."""
    return "-m" in cmd_args and cmd_args[cmd_args.index("-m") + 1 :][:1] == ["stalwart"]


# -- the server ------------------------------------------------------------------------------------
@dataclass
class Session:
    conn: socket.socket | None  # None once the client is gone
    pid: int


class Server:
    def __init__(self, path: str, preload: list[str], parent: int) -> None:
        self.path, self.parent = path, parent
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.inode = os.stat(path).st_ino
        self.listener.listen(128)  # clients may connect while the preload runs; they queue here
        # The first module before any fork; the rest while idle, so the first start waits only for what
        # every worker needs (a script may fail before it imports anything else) and restarts find all.
        self.packages = {"stalwart"} | {m.split(".")[0] for m in preload} - {"torch"}
        self.pending = list(preload)
        self.sources: dict[str, float] = {}
        if self.pending:
            self.preload_next()
        self.sessions: dict[int, Session] = {}  # worker pid → its client's connection
        self._wake: tuple[int, int] = (-1, -1)

    def preload_next(self) -> None:
        name = self.pending.pop(0)
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as err:  # the workers import it themselves and report the error where it matters
            log.warning("zygote could not preload %s: %s", name, err)
        self.sources = self._sources(self.packages)
        gc.freeze()  # workers' garbage collections then leave the shared module objects (and pages) alone
        log.info("zygote preloaded %s in %.2f s (%d modules)", name, time.monotonic() - t0, len(sys.modules))

    @staticmethod
    def _sources(packages: set[str]) -> dict[str, float]:
        """Source files of the loaded modules of these packages: stalwart's and the user's preloads
        (an installed torch does not change under a running job)."""
        out = {}
        for name, mod in list(sys.modules.items()):
            path = getattr(mod, "__file__", None)
            if name.split(".")[0] in packages and path and os.path.exists(path):
                out[path] = os.path.getmtime(path)
        return out

    def stale(self) -> str | None:
        for path, mtime in self.sources.items():
            try:
                if os.path.getmtime(path) != mtime:
                    return f"{path} changed since the zygote loaded it"
            except OSError:
                return f"{path} is gone"
        return None

    def serve(self) -> None:
        # A worker's exit must reach its client at once (TorchElastic waits on the client while
        # stopping a group): SIGCHLD wakes the select through this pipe.
        wake_r, wake_w = self._wake = os.pipe()
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        retiring = False  # no more forks (stale code): serve the running workers to their end, then exit
        while os.getppid() == self.parent and not (retiring and not self.sessions):
            conns = {s.conn.fileno(): s for s in self.sessions.values() if s.conn is not None}
            listen = [] if retiring else [self.listener]
            readable, _, _ = select.select(
                [*listen, wake_r, *(s.conn for s in conns.values())],
                [],
                [],
                0.05 if self.pending and not retiring else 1.0,
            )
            if not readable and self.pending:
                self.preload_next()
            for r in readable:
                if r == wake_r:
                    os.read(wake_r, 4096)
                elif r is self.listener:
                    if not self.accept():
                        retiring = True
                        self.listener.close()
                        os.unlink(self.path)  # the agent starts a fresh zygote for the next start
                else:  # the only thing a client ever sends after its request is EOF: it died
                    session = conns[r.fileno()]
                    try:
                        gone = not r.recv(1)
                    except OSError:
                        gone = True
                    if gone:
                        _kill(session.pid)
                        r.close()
                        session.conn = None
            self.reap()

    def accept(self) -> bool:
        """Fork a worker for one client; False when this zygote must go (stale code)."""
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        fds: list[int] = []
        try:
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            size = struct.unpack("!I", head)[0]
            assert size <= MAX_REQUEST, "request too large"
            body = bytearray()
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ConnectionError("client closed mid-request")
                body += chunk
            request = json.loads(body)
            parse_python_args(request["argv"])
            if request["env"].get("PYTHONPATH", "") != os.environ.get("PYTHONPATH", ""):
                raise ValueError("its PYTHONPATH is not the zygote's (sys.path is set when python starts)")
        except (OSError, ValueError, AssertionError, KeyError, struct.error) as err:
            _reply(conn, {"cold": f"zygote cannot run this worker: {err}"})
            conn.close()
            for fd in fds:
                os.close(fd)
            return True
        reason = self.stale() or _unforkable()
        if reason:
            _reply(conn, {"cold": reason})
            conn.close()
            for fd in fds:
                os.close(fd)
            return False
        for stream in (sys.stdout, sys.stderr):  # nothing of the zygote's buffers may reach a worker's log
            stream.flush()
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            for fd in self._wake:
                os.close(fd)
            self.listener.close()
            for s in self.sessions.values():
                if s.conn is not None:
                    s.conn.close()
            conn.close()
            become_worker(request, fds, zygote_pid)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        _reply(conn, {"pid": pid})
        self.sessions[pid] = Session(conn, pid)
        return True

    def reap(self) -> None:
        while self.sessions:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            session = self.sessions.pop(pid, None)
            if session is None or session.conn is None:
                continue
            if os.WIFSIGNALED(status):
                _reply(session.conn, {"signal": os.WTERMSIG(status)})
            else:
                _reply(session.conn, {"exit": os.waitstatus_to_exitcode(status)})
            session.conn.close()

    def close(self) -> None:
        for session in self.sessions.values():
            _kill(session.pid)
        self.listener.close()
        try:
            if os.stat(self.path).st_ino == self.inode:  # not a successor's socket
                os.unlink(self.path)
        except OSError:
            pass


def _unforkable() -> str | None:
    """Why forking this process would give a broken worker, if it would."""
    if threading.active_count() != 1:
        return "the zygote has Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child cannot use CUDA then
        return "CUDA was initialized in the zygote"
    return None


def _reply(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _kill(pid: int) -> None:
    """The worker and what it started (it leads its own process group, as a cold worker does)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the launcher's side --------------------------------------------------------------------------
def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--warm-start",
        choices=("on", "off"),
        default="on",
        help="start workers by forking a per-node process that has torch (and stalwart's "
        "trainer for `-m stalwart`) imported already: restarts skip seconds of imports "
        "(default on; off = a fresh interpreter per worker, as torchrun)",
    )
    group.add_argument(
        "--warm-preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module the warm-start process imports ahead (repeatable), e.g. your model's",
    )


def from_args(args: argparse.Namespace, cmd: str, cmd_args: list[str]) -> Zygote | None:
    """The node's zygote, started, when warm start applies: on, and workers are ``python ARGS``."""
    if args.warm_start == "off" or cmd != sys.executable:
        return None
    try:
        parse_python_args(list(cmd_args))
    except ValueError:
        return None
    zygote = Zygote(preload_for(list(cmd_args)) + list(args.warm_preload))
    zygote.ensure()
    return zygote


class Zygote:
    """Starts and replaces the node's zygote; gives TorchElastic the client as the worker entrypoint."""

    def __init__(self, preload: list[str], directory: Path | None = None) -> None:
        self.preload = preload
        self.dir = Path(directory or tempfile.mkdtemp(prefix="stalwart-zygote-"))
        self.pids_dir = self.dir / "pids"
        self.pids_dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "zygote.sock"
        self.proc: subprocess.Popen | None = None

    def entrypoint(self, cmd_args: list[str]) -> tuple[str, list[str]]:
        return sys.executable, ["-S", str(CLIENT), *cmd_args]

    def env(self) -> dict[str, str]:
        return {zygote_client.ENV_SOCKET: str(self.socket), zygote_client.ENV_PIDS: str(self.pids_dir)}

    def ensure(self) -> None:
        """Before each start of the workers: a zygote is running (started now if the last one exited,
        e.g. on stale code), and the previous workers' pid records are gone."""
        for old in self.pids_dir.iterdir():
            old.unlink(missing_ok=True)
        if self.proc is not None and self.proc.poll() is None and self.socket.exists():
            return  # (a retiring zygote has removed its socket; it exits when its workers have)
        self.socket.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stalwart.launch.zygote",
                "--socket",
                str(self.socket),
                "--parent",
                str(os.getpid()),
                *(f"--preload={m}" for m in self.preload),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # a Ctrl-C to the agent's group is the agent's
        deadline = time.monotonic() + 10  # the socket exists before the preload starts
        while not self.socket.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def worker_pid(self, pid: int) -> int:
        """The real worker behind a client pid (for stack dumps); the pid itself when started cold."""
        try:
            return int((self.pids_dir / str(pid)).read_text())
        except (OSError, ValueError):
            return pid

    def stop(self, wait: bool = True) -> None:
        """SIGTERM, then SIGKILL after 5 s; ``wait=False`` (a preempted agent in a hurry) leaves its exit
        to it: it also dies with the agent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5 if wait else 0)
            except subprocess.TimeoutExpired:
                if wait:
                    self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="stalwart's warm-start fork server (started by the agent)")
    p.add_argument("--socket", required=True)
    p.add_argument("--parent", type=int, required=True, help="exit when this process (the agent) is gone")
    p.add_argument("--preload", action="append", default=[])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    runtime.die_with_parent(args.parent)
    # A preload that asks torch.cuda.is_available() would otherwise initialise the CUDA driver here
    # (cuInit) without torch.cuda.is_initialized() saying so, and every forked worker's CUDA would fail.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    server = Server(args.socket, args.preload, args.parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # workers are stopped by the agent, through their stand-ins
    try:
        server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    main()
