"""The worker entrypoint under warm start: a stdlib-only stand-in that has the zygote fork the worker.

TorchElastic starts this file (``python -S zygote_client.py ARGS``, ~20 ms) where it would start
``python ARGS`` (seconds of imports). It hands its stdin/stdout/stderr, environment, working directory
and ARGS to the zygote (``stalwart.launch.zygote``), which forks a child that has torch imported
already and runs ARGS there. This process then stands in for the worker: signals it gets go to the
worker (SIGCONT after a terminating one, so a stopped worker dies too), and it exits as the worker did
(same code, or killed by the same signal) so TorchElastic sees no difference. If it dies itself, the
zygote kills the worker. Anything unexpected — no zygote, a refusal, a broken socket before the fork —
falls back to a cold start by exec'ing ``python ARGS``.

Kept free of stalwart and torch imports on purpose: it runs with ``-S`` (no site-packages).
"""

import json
import os
import select
import signal
import socket
import struct
import sys
import time

ENV_SOCKET = "STALWART_ZYGOTE"
ENV_PIDS = "STALWART_ZYGOTE_PIDS"  # directory: <this pid> → the worker's pid (for stack dumps)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def cold_start(args: list[str], why: str) -> None:
    if why:
        print(f"stalwart warm start: {why}; starting cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *args])


def open_fds() -> list[int]:
    """stdin/stdout/stderr that are open (a launcher may have closed stdin)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            pass
    return fds


TERMINATED = []  # when the first terminating signal came (time.monotonic()), for the slow-exit word


def forward(child: int):
    def send(sig: int) -> None:  # to the worker's process group, as TorchElastic's killpg would
        try:
            os.killpg(child, sig)
        except OSError:
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass

    def handler(signum: int, _frame) -> None:
        send(signum)
        if signum != signal.SIGUSR1 and signum != signal.SIGUSR2:
            send(signal.SIGCONT)  # a stopped worker keeps a pending SIGTERM forever
            TERMINATED[:] = TERMINATED or [time.monotonic()]

    return handler


def record_pid(child: int) -> None:
    directory = os.environ.get(ENV_PIDS)
    if directory:
        try:
            with open(os.path.join(directory, str(os.getpid())), "w") as f:
                f.write(str(child))
        except OSError:
            pass


def stat_fields(pid: int) -> list[bytes]:
    """``/proc/PID/stat`` after the command name (field 3, the state, first); [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def zombie_status(pid: int):
    """The worker's wait status if it has died but the zygote has not reaped it yet (a zombie), else
    None. The zygote reaps and reports between its own work; while it imports a module ahead (seconds)
    it cannot, and TorchElastic must still see the worker's exit at once."""
    fields = stat_fields(pid)
    if fields[:1] != [b"Z"] or len(fields) < 50:
        return None
    return int(fields[49])  # field 52, exit_code: the status as waitpid reports it (Linux ≥ 3.5)


class Replies:
    """The zygote's replies, one JSON object per line; ``next(timeout)`` is None when none came in time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def next(self, timeout=None):
        while b"\n" not in self.buf:
            if not select.select([self.sock], [], [], timeout)[0]:
                return None
            chunk = self.sock.recv(4096)
            if not chunk:  # the zygote went away
                return {}
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line or b"{}")


def wait_for_worker(replies: Replies, child: int, slow_s: float = 5.0) -> dict:
    """The zygote's last word on the worker, or the worker's status read from /proc if it died first.
    Says once (stderr) when the worker has not ended ``slow_s`` after a terminating signal, and in
    which state it is, so that a slow stop has a name (TorchElastic waits up to 30 s, then kills)."""
    said = False
    while True:
        try:
            last = replies.next(timeout=0.1)
        except (OSError, ValueError):
            return {}
        if last is not None:
            return last
        if not said and TERMINATED and time.monotonic() - TERMINATED[0] > slow_s:
            said = True
            print(
                f"stalwart warm start: worker {child} not ended {slow_s:g} s after a stop signal "
                f"(state {(stat_fields(child) or [b'gone'])[0].decode()}; no word from the zygote)",
                file=sys.stderr,
                flush=True,
            )
        status = zombie_status(child)
        if status is not None:
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"exit": os.WEXITSTATUS(status)}


def main() -> None:
    args = sys.argv[1:]
    path = os.environ.get(ENV_SOCKET)
    if not path:
        cold_start(args, "")
    fds = open_fds()
    request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}).encode()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socket.send_fds(sock, [struct.pack("!I", len(request))], fds)
        sock.sendall(request)
        replies = Replies(sock)
        first = replies.next()
    except (OSError, ValueError) as err:
        cold_start(args, f"zygote unreachable ({err})")
    if "pid" not in first:
        cold_start(args, first.get("cold", "zygote refused"))
    child = int(first["pid"])
    for sig in FORWARDED:
        signal.signal(sig, forward(child))
    record_pid(child)
    last = wait_for_worker(replies, child)
    if "signal" in last:
        sig = int(last["signal"])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    if "exit" not in last:
        print("stalwart warm start: the zygote went away; worker status unknown", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(int(last["exit"]))


if __name__ == "__main__":
    main()
