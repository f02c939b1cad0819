"""The c10d rendezvous store, served by the job master instead of by one of the agents.

TorchElastic's c10d rendezvous keeps its state in a ``TCPStore`` that, by default, the first agent on
the endpoint's host serves, so losing that node kills the whole job (pytorch#67742) — exactly the
node loss an elastic job must survive. Served by the master, the store outlives every node; agents
that get the endpoint from the master connect as clients (rendezvous option ``is_host=false``).

Limit: the store lives in the master's memory. A restarted master serves an empty store on the same
port; running workers are unaffected (their process group has its own store), but agents need the
store again only at their next rendezvous, which then starts from an empty state.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import TCPStore


def serve_store(host: str, port: int = 0, timeout_s: float = 60.0) -> TCPStore:
    """A store server on ``host:port`` (0 = any free port; ``store.port`` tells which)."""
    return TCPStore(
        host, port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def client_rdzv_conf(conf: str) -> str:
    """torchrun's ``--rdzv-conf`` with ``is_host=false`` added (agents never serve the store)."""
    items = [kv for kv in conf.split(",") if kv.strip() and not kv.strip().startswith("is_host=")]
    return ",".join([*items, "is_host=false"])
