"""MasterClient's retry window: counted from when the master was first found unreachable, not per call."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from stalwart.launch.client import MasterClient, MasterError
from stalwart.utils.ports import free_port


class _Answers(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/v1/slow-drop":  # waits, then hangs up without an answer (ConnectionResetError)
            time.sleep(0.5)
            self.close_connection = True
            return
        status = 200 if self.path == "/v1/status" else 404
        body = json.dumps({"ok": True} if status == 200 else {"error": "no such route"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _timed(call) -> float:
    started = time.monotonic()
    with pytest.raises(OSError):
        call()
    return time.monotonic() - started


def test_an_unreachable_master_is_waited_for_once_then_each_call_fails_at_once():
    port = free_port()
    client = MasterClient(f"http://127.0.0.1:{port}", "tok", timeout_s=1.0, retry_for_s=3.0)
    assert _timed(lambda: client.call("GET", "/v1/status")) >= 3.0, "the first call waits the window"
    assert _timed(lambda: client.call("GET", "/v1/status")) < 1.5, "the window is spent: no second wait"
    assert _timed(lambda: client.call("GET", "/v1/status", retry_for_s=0)) < 1.5

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert client.call("GET", "/v1/status") == {"ok": True}
        assert client.unreachable_since is None, "an answer ends the outage"
        with pytest.raises(MasterError):
            client.call("GET", "/v1/nowhere")
        assert client.unreachable_since is None, "an error answer is an answer"
    finally:
        server.shutdown()
        server.server_close()
    started = time.monotonic()
    assert _timed(lambda: client.call("GET", "/v1/status", retry_for_s=0.5)) >= 0.5, "a new outage: a new window"
    assert time.monotonic() - started < 2.5, "a call's own shorter retry bounds it, not the 3 s window"


def test_a_call_that_failed_while_another_got_an_answer_opens_no_outage():
    """The heartbeat thread and the main loop share the client: a beat that began before, and failed
    after, the main loop's answer must not start a retry window (it would shorten the next outage's)."""
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = MasterClient(f"http://127.0.0.1:{port}", "tok", timeout_s=2.0, retry_for_s=5.0)
        failed = []

        def beat() -> None:
            try:
                client.call("GET", "/v1/slow-drop", retry_for_s=0)
            except OSError as err:
                failed.append(err)

        thread = threading.Thread(target=beat)
        thread.start()
        time.sleep(0.1)
        assert client.call("GET", "/v1/status") == {"ok": True}  # answered while the beat waits
        thread.join(5)
        assert failed, "the dropped call failed"
        assert client.unreachable_since is None
    finally:
        server.shutdown()
        server.server_close()
