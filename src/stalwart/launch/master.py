"""The job master: an authenticated HTTP+JSON API over the SQLite journal, served by aiohttp on an
event loop of its own (a thread per connection made a thousand agents' beats wait seconds).

No pickle on the wire, a bearer token on every call (401 without one, 403 with a wrong one), loopback
unless told otherwise. All state is in the journal, so `kill -9` and a restart with the same
``--db`` resume the job; agents retry through the gap (see ``client.MasterClient``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from stalwart.launch import dashboard, presence
from stalwart.launch.api_error import ApiError
from stalwart.launch.autoscale import Autoscaler
from stalwart.launch.eviction import EvictionPolicy
from stalwart.launch.job_trace import master_trace
from stalwart.launch.journal import Journal
from stalwart.launch.master_state import MasterState
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
    ("GET", re.compile(rf"^{API}/trace$"), lambda s, b, m: master_trace(s.journal)),  # the dashboard's download
    ("GET", re.compile(rf"^{API}/nodes/lost$"), lambda s, b, m: s.lost()),
    ("POST", re.compile(rf"^{API}/ckpt$"), lambda s, b, m: s.ckpt.exchange(b)),  # docs/protocol.md
]


METRICS = "/metrics"  # Prometheus scrapes with `authorization: {credentials: TOKEN}` (bearer)
SLOW_ROUTES = ("GET",)  # whole-job reads (status, trace, /metrics) run off the event loop; writes are µs


def _app(state: MasterState, token: str) -> Any:
    """The aiohttp application: one handler for every path, so the token rule, the body rule and the
    error replies are in one place."""
    from aiohttp import web

    expected = f"Bearer {token}".encode()
    registry = None

    def reply(status: HTTPStatus, payload: dict[str, Any] | bytes, content_type: str = "application/json") -> Any:
        headers = {"Content-Type": content_type}
        if status == HTTPStatus.UNAUTHORIZED:
            headers["WWW-Authenticate"] = 'Bearer realm="stalwart"'
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return web.Response(status=status, body=data, headers=headers)

    async def body_of(request: Any) -> dict[str, Any]:
        if (request.content_length or 0) > MAX_BODY:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body, no Content-Length to check first
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes") from None
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(HTTPStatus.BAD_REQUEST, "body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    def metrics() -> bytes:
        nonlocal registry
        from prometheus_client import CollectorRegistry, generate_latest

        from stalwart.launch.master_histograms import SectionHistogramCollector
        from stalwart.launch.master_metrics import JournalCollector

        if registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(JournalCollector(state))
            registry.register(SectionHistogramCollector(state.journal.nodes, state.journal.incidents))
        return generate_latest(registry)

    async def hold_presence(request: Any) -> Any:
        """Read a node's presence body until it ends (the node left) or breaks (it is lost)."""
        node_id = request.query.get("node_id", "")
        if not node_id:
            raise ApiError(HTTPStatus.BAD_REQUEST, "presence needs ?node_id=")
        try:
            while await request.content.readany():
                pass
        except Exception:  # cut off without the final chunk (ConnectionResetError, aiohttp's payload errors)
            state.presence_lost(node_id)
            return reply(HTTPStatus.OK, {"lost": True})  # nobody reads it
        return reply(HTTPStatus.OK, {"ok": True})

    async def handle(request: Any) -> Any:
        method, path = request.method, request.path
        if method == "GET" and path == dashboard.PATH:  # a static page, no job data: no token
            return reply(HTTPStatus.OK, dashboard.page(), dashboard.CONTENT_TYPE)
        loop = asyncio.get_running_loop()
        try:
            auth = request.headers.get("Authorization", "").encode()
            if not auth:
                raise ApiError(HTTPStatus.UNAUTHORIZED, "missing bearer token")
            if not hmac.compare_digest(auth, expected):
                raise ApiError(HTTPStatus.FORBIDDEN, "wrong job token")
            if method == "GET" and path == METRICS:
                from prometheus_client import CONTENT_TYPE_LATEST

                return reply(HTTPStatus.OK, await loop.run_in_executor(None, metrics), CONTENT_TYPE_LATEST)
            if method == "POST" and path == presence.PATH:
                return await hold_presence(request)
            for verb, pattern, route in ROUTES:
                match = pattern.match(path)
                if match and verb == method:
                    body = await body_of(request)
                    if method in SLOW_ROUTES:
                        return reply(HTTPStatus.OK, await loop.run_in_executor(None, route, state, body, match))
                    return reply(HTTPStatus.OK, route(state, body, match))
            raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
        except ApiError as err:
            return reply(err.status, {"error": str(err)})
        except Exception as err:  # never let a bad request take the master down
            log.exception("request failed")
            return reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": type(err).__name__})

    app = web.Application(client_max_size=MAX_BODY + 1)  # ours answers first, as JSON
    app.router.add_route("*", "/{path:.*}", handle)
    return app


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
        autoscaler: Autoscaler | None = None,
    ) -> None:
        if not token:
            raise ValueError("the master needs a job token")
        self.journal = Journal(db)
        self.state = MasterState(self.journal, job_id, restart_budget, node_timeout_s, stragglers, policy, autoscaler)
        self.store = None
        if rdzv_port is not None:  # the agents' rendezvous store lives here, not on one of the nodes
            from stalwart.launch.store import serve_store

            self.store = serve_store(host, rdzv_port)
            self.state.rdzv_endpoint = f"{advertised_host(host)}:{self.store.port}"
        self._app = _app(self.state, token)
        # Bound now (a taken port fails here, and `address` is known before start); agents beat in
        # bursts, each beat a new connection: a short listen backlog drops SYNs, retried only after 1 s.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
        self._stop = threading.Event()
        self._serving: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: BaseException | None = None

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{advertised_host(host)}:{port}"

    def _serve(self, ready: threading.Event) -> None:
        """The server thread: its own event loop (the agent's main thread is TorchElastic's)."""
        from aiohttp import web

        loop = asyncio.new_event_loop()
        runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=1.0)
        try:
            loop.run_until_complete(runner.setup())
            site = web.SockSite(runner, self._sock, backlog=socket.SOMAXCONN)
            loop.run_until_complete(site.start())
        except BaseException as err:
            self._failed = err
            ready.set()
            raise
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.state.sweep()

    def start(self) -> Master:
        ready = threading.Event()
        self._serving = threading.Thread(target=self._serve, args=(ready,), name="master-http", daemon=True)
        self._serving.start()
        ready.wait()
        if self._failed is not None:
            raise RuntimeError(f"the master's HTTP server did not start: {self._failed}") from self._failed
        threading.Thread(target=self._sweep_loop, name="master-sweep", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._stop.is_set():
            return  # stopped already (a test's restart, then its fixture)
        self._stop.set()
        if self._serving is not None and self._loop is not None:  # never started: nothing to wait for
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._serving.join(10)
        self._sock.close()
        self.journal.close()
