"""Peer memory replicas, the wire and the receiving side: a node's keeper accepts copies of other
nodes' snapshots into its own shared memory, so a node that dies does not take its ranks' only
in-memory state with it (issue 16). See docs/checkpoint.md, "Peer replicas".

One push is one TCP connection carrying one rank's slot::

    {"v": 1, "src": node, "rank": r, "ranks": [...], "header": {...}, "bin_bytes": n, "obj_bytes": m,
     "mac": HMAC-SHA256(key, this line without "mac")}\\n
    ← {"ready": true, "nonce": n} | {"ok": false, "error": "..."}\\n   (the sender waits: a refusal costs no data)
    <n bytes: slot<i>.bin> <m bytes: slot<i>.obj>
    {"mac": HMAC-SHA256(key, header line + nonce + CRC32 of the slot's bytes)}\\n
    ← {"ok": true} | {"ok": false, "error": "..."}\\n

The key is the job token (never sent); the bytes are checked against the signed CRC32s, not MACed. A
copy is published (its header written) only after the trailer checks out, in a rank's own layout
(``<job dir>/replicas/<src node>/rank<r>/``, ``shm.JobPaths``), so restore reads it with the same code;
the header gains ``replica: {src, crc32_bin, received}``, against which a restore verifies it again.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import socketserver
import threading
import time
import zlib
from pathlib import Path
from typing import IO, Any

from stalwart.checkpoint.shm import (
    REPLICAS_DIR,
    SLOTS,
    JobPaths,
    atomic_write,
    complete_slots,
    data_crc32,
    read_json,
    secure_dir,
)
from stalwart.checkpoint.snapshot import trajectory_of

log = logging.getLogger("stalwart.checkpoint.replicas")
VERSION = 1
CHUNK = 4 << 20
MAX_LINE = 16 << 20  # a header line with a large model's entry table (read before its MAC is checked)
RESTORED = "restored.json"  # in REPLICAS_DIR: the step and time of this host's last restore


def replica_roots(job_root: Path) -> list[Path]:
    """The directories holding other nodes' replicas on this host (one per source node)."""
    try:
        return sorted(p for p in (job_root / REPLICAS_DIR).iterdir() if p.is_dir() and not p.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return []


def host_roots(paths: JobPaths) -> list[JobPaths]:
    """Where this host holds snapshots of the job: the node's own directory, then each peer's copies."""
    return [paths, *(JobPaths(p) for p in replica_roots(paths.root))]


def canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sign(key: bytes, obj: dict[str, Any]) -> str:
    return hmac.new(key, canonical(obj), hashlib.sha256).hexdigest()


def safe_name(node: str) -> str:
    """A node id as a directory name (ids come from the network: no path tricks)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", node)[:128]
    if name in ("", ".", ".."):
        raise ValueError(f"bad node id {node!r}")
    return name


def background_priority() -> None:
    """Let this thread yield the CPU to training: copies are background work (nice is per thread on Linux)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


class ReplicaError(ValueError):
    """A push that is refused: bad MAC, torn transfer, checksum mismatch, both slots busy."""


class Superseded(ReplicaError):
    """The sender's slot was overwritten by a newer snapshot while it was sent: push the newer one."""


def trailer_mac(key: bytes, line: bytes, nonce: str, crc: int) -> str:
    """The trailer's MAC: binds the data's CRC32 to the signed header line and to the receiver's nonce
    (one push, one slot; a recorded push cannot be replayed)."""
    return hmac.new(key, line + f"|{nonce}|crc32={crc}".encode(), hashlib.sha256).hexdigest()


def _read_exact(rfile: IO[bytes], n: int, sink: Any) -> int:
    """Copy ``n`` bytes from the socket to ``sink`` (a file or a list); their CRC32."""
    crc, left = 0, n
    while left:
        chunk = rfile.read(min(CHUNK, left))
        if not chunk:
            raise ReplicaError(f"connection closed with {left} of {n} bytes unsent")
        crc = zlib.crc32(chunk, crc)
        if isinstance(sink, list):
            sink.append(chunk)
        else:
            sink.write(chunk)
        left -= len(chunk)
    return crc


def _received(info: Any) -> float:
    return float(info.header.get("replica", {}).get("received", 0.0))


def _lock_free_slot(paths: JobPaths, rank: int) -> tuple[int, int] | None:
    """(slot, fd with an exclusive lock) to write a replica into: the slot not holding the copy that
    arrived last, else the other; None if readers (a restore) hold both."""
    held = sorted(complete_slots(paths, rank), key=_received, reverse=True)
    newest = held[0].slot if held else None
    for slot in sorted(SLOTS, key=lambda s: s == newest):
        fd = os.open(paths.slot(rank, slot, "bin"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot, fd
    return None


def restore_floor(job_root: Path) -> dict[str, Any]:
    """The last restore on this host: {step, trajectory}; copies of later steps taken before it (an
    earlier trajectory: ``snapshot.trajectory_of``) belong to the abandoned trajectory (see
    ``peer_restore.invalidate_replicas_after``)."""
    return read_json(job_root / REPLICAS_DIR / RESTORED) or {"step": -1, "trajectory": [0, 0]}


class ReplicaStore:
    """Other nodes' snapshots in this node's shared memory, written only by verified pushes."""

    def __init__(self, job_root: Path, key: bytes) -> None:
        self.job_root, self.key = job_root, key
        self.received = 0
        self.refused = 0
        self._lock = threading.Lock()  # one source's rank directory pruned while another push writes it

    def receive(self, rfile: IO[bytes], wfile: IO[bytes]) -> dict[str, Any]:
        """Read one push from ``rfile`` and publish it; raises :class:`ReplicaError` if refused. The
        sender sends the bytes only after ``ready`` (a refusal never meets a broken pipe)."""
        line = rfile.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            raise ReplicaError("header line missing or too long")
        msg = json.loads(line)
        if not isinstance(msg, dict) or not hmac.compare_digest(str(msg.pop("mac", "")), sign(self.key, msg)):
            raise ReplicaError("header not signed with this job's key")
        if msg.get("v") != VERSION:
            raise ReplicaError(f"protocol version {msg.get('v')}, this node speaks {VERSION}")
        src, rank, header = safe_name(str(msg["src"])), int(msg["rank"]), dict(msg["header"])
        n_bin, n_obj = int(msg["bin_bytes"]), int(msg["obj_bytes"])
        if header.get("rank") != rank or n_bin != int(header["data_bytes"]) or n_bin < 0 or not 0 <= n_obj < MAX_LINE:
            raise ReplicaError("header does not describe the rank and sizes it carries")
        floor = restore_floor(self.job_root)
        if int(header["step"]) > floor["step"] and trajectory_of(header) < tuple(floor.get("trajectory", (0, 0))):
            raise ReplicaError(f"step {header['step']} was taken before this host restored step {floor['step']}")
        paths = JobPaths(self.job_root / REPLICAS_DIR / src)
        for d in (paths.root.parent, paths.root, paths.rank_dir(rank)):
            secure_dir(d)
        with self._lock:
            self._prune(paths, [int(r) for r in msg.get("ranks", [rank])])
        got = _lock_free_slot(paths, rank)
        if got is None:
            raise ReplicaError(f"both replica slots of {src} rank {rank} are being read")
        slot, fd = got
        try:
            paths.slot(rank, slot, "json").unlink(missing_ok=True)  # torn until the header is back
            os.ftruncate(fd, n_bin)
            if n_bin:
                os.posix_fallocate(fd, 0, n_bin)  # a full tmpfs refuses now, not half-way (nor SIGBUS)
            nonce = secrets.token_hex(16)
            wfile.write(json.dumps({"ready": True, "nonce": nonce}).encode() + b"\n")
            wfile.flush()
            with os.fdopen(os.dup(fd), "wb") as f:
                crc = _read_exact(rfile, n_bin, f)
            obj_parts: list[bytes] = []
            _read_exact(rfile, n_obj, obj_parts)
            trailer = json.loads(rfile.readline(4096) or b"{}")
            expected = trailer_mac(self.key, line.rstrip(b"\n"), nonce, crc)
            if not isinstance(trailer, dict) or not hmac.compare_digest(str(trailer.get("mac", "")), expected):
                raise ReplicaError("data does not match the CRC32 the sender signed")
            blob = b"".join(obj_parts)
            if zlib.crc32(blob) != header.get("objects_crc32"):
                raise ReplicaError("objects do not match their header's CRC32")
            atomic_write(paths.slot(rank, slot, "obj"), blob)
            header["replica"] = {"src": src, "crc32_bin": crc, "received": time.time()}
            atomic_write(paths.slot(rank, slot, "json"), json.dumps(header).encode())
        finally:
            os.close(fd)
        self.received += 1
        return {"src": src, "rank": rank, "step": header["step"], "slot": slot}

    def _prune(self, paths: JobPaths, ranks: list[int]) -> None:
        """A source that now holds other ranks (a regroup) leaves old copies behind: drop them."""
        for r in paths.ranks():
            if r not in ranks:
                shutil.rmtree(paths.rank_dir(r), ignore_errors=True)

    def prune_silent(self, seconds: float) -> list[str]:
        """Free the copies of sources that pushed nothing for ``seconds`` (lost, evicted, parked)."""
        gone = []
        with self._lock:
            for root in replica_roots(self.job_root):
                stamps = [p.stat().st_mtime for p in root.glob("rank*/slot*.json")] or [root.stat().st_mtime]
                if time.time() - max(stamps) > seconds:
                    shutil.rmtree(root, ignore_errors=True)
                    gone.append(root.name)
        return gone


class _Handler(socketserver.StreamRequestHandler):
    timeout = 60.0
    server: ReplicaServer

    def handle(self) -> None:
        background_priority()
        store = self.server.store
        if not self.server.slots.acquire(blocking=False):
            reply: dict[str, Any] = {"ok": False, "error": "too many pushes at once; try the next peer"}
        else:
            try:
                reply = {"ok": True, **store.receive(self.rfile, self.wfile)}
            except Exception as err:  # anything a peer (or a stranger) sends: refused, never a dead thread
                store.refused += 1
                log.warning("refused a replica from %s: %s", self.client_address[0], err)
                reply = {"ok": False, "error": str(err)}
            finally:
                self.server.slots.release()
        try:
            self.wfile.write(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


class ReplicaServer(socketserver.ThreadingTCPServer):
    """Accepts pushes on ``host`` (an ephemeral port) into ``store``; serve_forever on a thread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, store: ReplicaStore, concurrent: int = 16) -> None:
        self.store = store
        self.slots = threading.BoundedSemaphore(concurrent)  # pushes received at once (one thread each)
        super().__init__((host, 0), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> ReplicaServer:
        threading.Thread(target=self.serve_forever, name="stalwart-replica-server", daemon=True).start()
        return self


def header_version(path: Path) -> tuple[int, int] | None:
    """Which file a slot header is (headers are replaced by rename, never rewritten in place)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


class SlotSource:
    """One rank's complete slot, sent straight from shared memory (``socket.sendfile``), lock-free by
    default: the writer deletes a slot's header before overwriting it, so a header unchanged from the
    opening to the end of a send proves the bytes consistent (``unchanged``); else the send is cut off
    before its trailer. ``pin``: hold the slot's shared lock until ``close`` instead (the writer takes
    another slot; for states too large to send between two snapshots). CRC32 via a read-only mapping."""

    def __init__(self, paths: JobPaths, slot: Any, pin: bool = False) -> None:
        self.rank = slot.rank
        self._hdr = paths.slot(slot.rank, slot.slot, "json")
        self._before = header_version(self._hdr)
        self.file = open(paths.slot(slot.rank, slot.slot, "bin"), "rb")  # closed by close()
        try:
            self._open(paths, slot, pin)
        except BaseException:
            self.file.close()
            raise

    def _open(self, paths: JobPaths, slot: Any, pin: bool) -> None:
        where = f"rank {slot.rank} slot {slot.slot}"
        if pin:
            try:
                fcntl.flock(self.file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Superseded(f"{where} is being written") from None
        try:
            self.header: dict[str, Any] = json.loads(self._hdr.read_bytes())
        except FileNotFoundError:
            raise Superseded(f"{where} is being overwritten") from None
        if self.header.get("generation") != slot.generation:
            raise Superseded(f"{where} was overwritten before it was sent")
        self.size = int(self.header["data_bytes"])
        crc = data_crc32(self.file, self.size)
        if crc is None:  # being resized for a larger state
            raise Superseded(f"{where} is shorter than its header says")
        self.crc = crc
        self.objects = paths.slot(slot.rank, slot.slot, "obj").read_bytes()
        if not self.unchanged() or zlib.crc32(self.objects) != self.header["objects_crc32"]:
            raise Superseded(f"{where} was overwritten while it was read")

    def unchanged(self) -> bool:
        """No newer snapshot has begun to overwrite the slot since it was opened."""
        return self._before is not None and header_version(self._hdr) == self._before

    def close(self) -> None:
        self.file.close()  # and with it a pin

    def __enter__(self) -> SlotSource:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def send_copy(address: tuple[str, int], key: bytes, src: str, ranks: list[int], source: SlotSource) -> dict[str, Any]:
    """Push one slot to the replica server at ``address``; returns its reply. :class:`Superseded` when
    the slot was overwritten while it was sent (the connection is closed before the trailer)."""
    import socket

    msg = {"v": VERSION, "src": src, "rank": source.rank, "ranks": ranks, "header": source.header}
    msg.update(bin_bytes=source.size, obj_bytes=len(source.objects))
    line = canonical({**msg, "mac": sign(key, msg)})
    with socket.create_connection(address, timeout=30.0) as sock, sock.makefile("rb") as answers:
        sock.sendall(line + b"\n")
        ready = json.loads(answers.readline(4096) or b"{}")
        if not ready.get("ready"):
            raise ReplicaError(str(ready.get("error", "no answer")))
        nonce = str(ready.get("nonce", ""))
        if source.size:
            sock.sendfile(source.file, 0, source.size)
        sock.sendall(source.objects)
        if not source.unchanged():
            raise Superseded(f"rank {source.rank}'s slot was overwritten while it was sent")
        sock.sendall(json.dumps({"mac": trailer_mac(key, line, nonce, source.crc)}).encode() + b"\n")
        reply = json.loads(answers.readline(4096) or b"{}")
    if not reply.get("ok"):
        raise ReplicaError(str(reply.get("error", "no answer")))
    return reply
