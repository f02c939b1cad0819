"""A node's presence at the master: a dead node known in milliseconds, not after heartbeat timeouts.

Each agent keeps one HTTP request to the master open for its whole life (``POST /v1/nodes/presence``,
a chunked body it never finishes, one keep-alive chunk every few seconds). When the agent's process
dies — killed, crashed, its host's kernel still up — the kernel closes the socket and the master's
read fails at once: the node is lost (journaled, like a heartbeat timeout but seconds sooner). An agent
that leaves on purpose sends the final chunk first. A host that vanishes without closing its sockets
(power, network) is still found by the heartbeat timeout (``--node-timeout``).

The survivors of a lost node ask the master which nodes were lost since their round started
(``lost_since``): with a member gone, its ranks' snapshots went with it, so a save-on-failure that
waits for every rank's snapshot table cannot commit — skipping it saves its answer timeout, and the
round restores from the newest committed checkpoint.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.parse
from typing import Any

from stalwart.launch.client import MasterClient, MasterError

log = logging.getLogger("stalwart.agent")
PATH = "/v1/nodes/presence"
KEEPALIVE = b"1\r\n.\r\n"  # one chunk holding one byte: the master only reads until the end
FINAL = b"0\r\n\r\n"  # the last chunk: this node leaves on purpose


class Presence:
    """The agent's side: a daemon thread holding the request open, reconnecting after a master restart."""

    def __init__(self, address: str, token: str, node_id: str, keepalive_s: float = 5.0) -> None:
        url = urllib.parse.urlsplit(address)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the master's address must be http://HOST:PORT, got {address!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.token, self.node_id, self.keepalive_s = token, node_id, keepalive_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's keep-alive writes vs close()'s final chunk
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._loop, name="stalwart-presence", daemon=True)

    def start(self) -> Presence:
        self._thread.start()
        return self

    def _open(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10.0)
        conn.putrequest("POST", f"{PATH}?node_id={urllib.parse.quote(self.node_id)}")
        conn.putheader("Authorization", f"Bearer {self.token}")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.endheaders()
        conn.send(KEEPALIVE)
        return conn

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._conn = self._open()
                while not self._stop.wait(self.keepalive_s):
                    with self._lock:
                        if self._conn is None:
                            return
                        self._conn.send(KEEPALIVE)
            except OSError as err:  # the master restarts: come back when it does
                log.debug("presence connection to the master dropped (%s); reconnecting", err)
                self._drop()
                self._stop.wait(1.0)

    def _drop(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def close(self) -> None:
        """Leave on purpose: the final chunk, so the master does not take this node for lost."""
        self._stop.set()
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            try:
                conn.send(FINAL)
                conn.getresponse().read()
            except OSError:
                pass
            finally:
                conn.close()
        self._thread.join(2.0)


def lost_since(client: MasterClient, since: float, me: str) -> dict[str, Any]:
    """node id → its rendezvous identity (``_compat.rendezvous_node``), for the nodes the master found
    lost after ``since`` (wall clock) other than ``me``; {} when the master cannot say (unreachable:
    the caller proceeds as before)."""
    try:
        nodes: list[dict[str, Any]] = client.call("GET", "/v1/nodes/lost", retry_for_s=0).get("lost", [])
    except (MasterError, OSError) as err:
        log.warning("could not ask the master for lost nodes (%s); proceeding as if none", err)
        return {}
    return {
        n["node_id"]: n.get("rdzv_node") for n in nodes if n["node_id"] != me and float(n.get("lost_at") or 0) >= since
    }


def expire(handler: Any, lost: dict[str, Any]) -> None:
    """Take lost nodes out of the rendezvous now instead of after their keep-alive expires (best
    effort: on failure the keep-alive still removes them)."""
    from stalwart import _compat

    known = [node for node in lost.values() if node]
    try:
        expired = _compat.expire_rendezvous_nodes(handler, known) if known else 0
    except Exception as err:  # another torch, another rendezvous: the keep-alive expiry still works
        log.warning("could not expire lost nodes from the rendezvous (%s: %s)", type(err).__name__, err)
        return
    log.warning("lost node(s) %s: %d taken out of the rendezvous at once", ", ".join(lost), expired)


def after_loss(client: MasterClient, handler: Any, since: float, me: str) -> dict[str, Any]:
    """A survivor's part when its workers failed: if member nodes were lost since ``since``, expire them
    from the rendezvous and return why save-on-failure is skipped; {} when nobody was lost."""
    lost = lost_since(client, since, me)
    if not lost:
        return {}
    expire(handler, lost)
    return {"persisted": False, "detail": f"node(s) {', '.join(lost)} lost: restore from storage"}
