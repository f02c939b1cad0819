"""The rendezvous handler as the stalwart agent uses it: TorchElastic's, with the worker store ours.

A fresh worker store every round: torch shares the rendezvous TCP store with the workers across rounds
without a per-round prefix, so restarted workers would read their predecessors' gloo addresses and fail
with "connectFullMesh ... Connection refused", burning a restart. ``stalwart run`` therefore sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's switch: a bootstrap store per round) and the agent of
group rank 0 hosts each round's store itself before any worker starts (``serve_worker_store``); the
workers must then be told to connect to it as clients, which torch derives from ``use_agent_store``.
``RoundStoreHandler`` answers that question per round instead of flipping the process-wide variable.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo

from stalwart import _compat

log = logging.getLogger("stalwart.agent")


class RoundStoreHandler(RendezvousHandler):
    """Delegates to ``inner``; ``use_agent_store`` is True while the agent hosts this round's store."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self.inner = inner
        self.agent_hosts_store = False
        self.round: int | None = None  # the last completed round (``_compat.rendezvous_round``)

    @property
    def torch_shares_store(self) -> bool:
        """torch's own store sharing (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset: the user's choice)."""
        return self.inner.use_agent_store

    @property
    def use_agent_store(self) -> bool:
        return self.agent_hosts_store or self.inner.use_agent_store

    def get_backend(self) -> str:
        return self.inner.get_backend()

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        self.round = _compat.rendezvous_round(self.inner)
        return info

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Only nodes that can join: a node waiting beyond ``--nnodes`` MAX is a spare, not a reason
        for the members to restart (``_compat.waiting_nodes_that_fit``: torch's count causes a storm)."""
        return _compat.waiting_nodes_that_fit(self.inner)

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # anything else torch may read (e.g. ``settings``)
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def serve_worker_store(host: str, port: int) -> TCPStore | None:
    """This round's worker store (the TCPStore of the workers' process group), hosted by the agent of
    group rank 0 before any worker starts. Otherwise rank 0 hosts it, and restarted ranks that start
    together race it: a client that connects first backs off for up to ~0.7 s, the largest share of a
    warm restart. None when the port was taken meanwhile: then rank 0 hosts it, as torch would."""
    try:
        return TCPStore(host_name=host, port=port, is_master=True, multi_tenant=True, wait_for_workers=False)
    except (RuntimeError, OSError) as err:
        log.warning("could not host the worker store on port %s (%s); rank 0 hosts it", port, err)
        return None
