"""One call to the job master: JSON over HTTP with the job token, retried through a master restart.

Stdlib only, so the launcher's client (``stalwart.launch.client.MasterClient``) and a keeper asking the
master about membership (``stalwart.checkpoint.desk_host``) share one transport.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


class MasterError(RuntimeError):
    """The master answered with an error status (the message carries its reason)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"master answered {status}: {message}")
        self.status = status


def call_master(
    address: str,
    token: str,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 5.0,
    retry_for_s: float = 30.0,
) -> dict[str, Any]:
    """One API call. Connection failures are retried with backoff for ``retry_for_s`` (the master may be
    restarting); HTTP errors are not retried and raise MasterError."""
    data = json.dumps(body).encode() if body is not None else None
    deadline = time.monotonic() + retry_for_s
    delay = 0.05
    while True:
        request = urllib.request.Request(
            address.rstrip("/") + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", err.reason)
            except (json.JSONDecodeError, AttributeError):
                message = str(err.reason)
            raise MasterError(err.code, message) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
