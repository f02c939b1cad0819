"""The master's read-only dashboard page: ``GET /dashboard``.

The page itself is static and holds no job data, so it is served without the token; it asks for the
job token once (kept in the tab's ``sessionStorage``, never in a URL that a proxy or log would keep)
and polls ``GET /v1/status`` with it as a bearer header every 2 s: job state, nodes (health,
straggler and eviction flags), the incident timeline with detection and recovery times, curves of
loss, tokens/s and mean step-section times (from the ranks' histograms the heartbeats carry), the
job's slowest steps with their rank and longest section (a stall at its exact step and rank), the
ranks whose compute sections straggle (``observe.stragglers`` over the heartbeats' newest steps),
the checkpoint store as each node's keeper sees it (last committed step, its age, failing cause and
failed attempts), the checkpoint restore figures of recoveries, and the open hang's diagnosis.
"""

from __future__ import annotations

from importlib import resources

PATH = "/dashboard"
CONTENT_TYPE = "text/html; charset=utf-8"


def page() -> bytes:
    return resources.files("stalwart.launch").joinpath("dashboard.html").read_bytes()
