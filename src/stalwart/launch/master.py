"""The job master: an authenticated HTTP+JSON API over the SQLite journal.

No pickle on the wire, a bearer token on every call (401 without one, 403 with a wrong one), loopback
unless told otherwise. All state is in the journal, so `kill -9` and a restart with the same
``--db`` resume the job; agents retry through the gap (see ``client.MasterClient``).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from stalwart.launch import dashboard
from stalwart.launch.eviction import EvictionPolicy
from stalwart.launch.journal import Journal
from stalwart.launch.master_state import ApiError, MasterState
from stalwart.launch.stragglers import StragglerDetector

log = logging.getLogger("stalwart.master")
MAX_BODY = 1 << 20
API = "/v1"

Route = Callable[[MasterState, dict[str, Any], re.Match], dict[str, Any]]
ROUTES: list[tuple[str, re.Pattern, Route]] = [
    ("GET", re.compile(rf"^{API}/status$"), lambda s, b, m: s.status()),
    ("POST", re.compile(rf"^{API}/nodes/join$"), lambda s, b, m: s.join(b)),
    ("POST", re.compile(rf"^{API}/nodes/heartbeat$"), lambda s, b, m: s.heartbeat(b)),
    ("POST", re.compile(rf"^{API}/nodes/precheck$"), lambda s, b, m: s.precheck(b)),
    ("POST", re.compile(rf"^{API}/incidents$"), lambda s, b, m: s.open_incident(b)),
    ("PATCH", re.compile(rf"^{API}/incidents/(\d+)$"), lambda s, b, m: s.update_incident(int(m[1]), b)),
    ("POST", re.compile(rf"^{API}/restarts$"), lambda s, b, m: s.request_restart(b)),
    ("POST", re.compile(rf"^{API}/decisions$"), lambda s, b, m: s.decide(b)),
    ("POST", re.compile(rf"^{API}/chaos$"), lambda s, b, m: s.add_chaos(b)),
]


METRICS = "/metrics"  # Prometheus scrapes with `authorization: {credentials: TOKEN}` (bearer)


def _handler(state: MasterState, token: str) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode()
    registry = None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.client_address[0], *args)

        def _reply(
            self, status: HTTPStatus, payload: dict[str, Any] | bytes, content_type: str = "application/json"
        ) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if status == HTTPStatus.UNAUTHORIZED:
                self.send_header("WWW-Authenticate", 'Bearer realm="stalwart"')
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
            if not length:
                return {}
            try:
                body = json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ApiError(HTTPStatus.BAD_REQUEST, "body is not JSON") from None
            if not isinstance(body, dict):
                raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return body

        def _dispatch(self, method: str) -> None:
            if method == "GET" and self.path == dashboard.PATH:  # a static page, no job data: no token
                self._reply(HTTPStatus.OK, dashboard.page(), dashboard.CONTENT_TYPE)
                return
            try:
                auth = (self.headers.get("Authorization") or "").encode()
                if not auth:
                    raise ApiError(HTTPStatus.UNAUTHORIZED, "missing bearer token")
                if not hmac.compare_digest(auth, expected):
                    raise ApiError(HTTPStatus.FORBIDDEN, "wrong job token")
                path = self.path.split("?", 1)[0]
                if method == "GET" and path == METRICS:
                    self._metrics()
                    return
                for verb, pattern, route in ROUTES:
                    match = pattern.match(path)
                    if match and verb == method:
                        self._reply(HTTPStatus.OK, route(state, self._body(), match))
                        return
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
            except ApiError as err:
                self._reply(err.status, {"error": str(err)})
            except Exception as err:  # never let a bad request take the master down
                log.exception("request failed")
                self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": type(err).__name__})

        def _metrics(self) -> None:
            nonlocal registry
            from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

            from stalwart.launch.master_histograms import SectionHistogramCollector
            from stalwart.launch.master_metrics import JournalCollector

            if registry is None:
                registry = CollectorRegistry(auto_describe=False)
                registry.register(JournalCollector(state))
                registry.register(SectionHistogramCollector(state.journal.nodes, state.journal.incidents))
            self._reply(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PATCH(self) -> None:
            self._dispatch("PATCH")

    return Handler


def new_token() -> str:
    """A fresh job token: hex, so it can never start with '-' (a URL-safe token does one time in 64, and
    `--job-token -x…` is then parsed as an option)."""
    return secrets.token_hex(32)


def load_or_create_token(path: Path, token: str | None = None) -> str:
    """The job token: given, or read from `path`, or created there (mode 0600) on first start."""
    if token:
        return token
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    path.touch(mode=0o600)
    path.write_text(token)
    return token


def advertised_host(host: str) -> str:
    """The name others reach a bound address by: a wildcard bind (0.0.0.0, ::) is not an address
    another node can dial, so this host's name is advertised instead."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


class _Server(ThreadingHTTPServer):
    # Agents beat in bursts, each beat a new connection: socketserver's listen backlog of 5 made the
    # kernel drop SYNs beyond it under a thousand agents, and a dropped SYN is retried after 1 s, 3 s …
    request_queue_size = socket.SOMAXCONN
    daemon_threads = True


class Master:
    """Owns the server thread and the lost-node sweeper; `serve_forever` for the CLI."""

    def __init__(
        self,
        db: str | Path,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        job_id: str = "job",
        restart_budget: int = 3,
        node_timeout_s: float = 30.0,
        stragglers: StragglerDetector | None = None,
        rdzv_port: int | None = None,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if not token:
            raise ValueError("the master needs a job token")
        self.journal = Journal(db)
        self.state = MasterState(self.journal, job_id, restart_budget, node_timeout_s, stragglers, policy)
        self.store = None
        if rdzv_port is not None:  # the agents' rendezvous store lives here, not on one of the nodes
            from stalwart.launch.store import serve_store

            self.store = serve_store(host, rdzv_port)
            self.state.rdzv_endpoint = f"{advertised_host(host)}:{self.store.port}"
        self.server = _Server((host, port), _handler(self.state, token))
        self._stop = threading.Event()
        self._serving: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{advertised_host(host)}:{port}"

    def _sweep_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.state.sweep()

    def start(self) -> Master:
        self._serving = threading.Thread(target=self.server.serve_forever, name="master-http", daemon=True)
        self._serving.start()
        threading.Thread(target=self._sweep_loop, name="master-sweep", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._serving is not None:  # shutdown() waits for serve_forever: forever if it never ran
            self.server.shutdown()
        self.server.server_close()
        self.journal.close()
