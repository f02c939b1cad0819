"""Every private PyTorch API stalwart relies on, in one place.

Supported torch range: see ``SUPPORTED_TORCH`` (pyproject.toml pins the tested bounds). Each
reach-in below has a test in ``tests/unit/test_compat.py`` that fails loudly when torch changes it,
so a torch upgrade breaks one module and one test file, not the agent or the checkpoint at run time.
Nothing outside this module imports a private torch name (``torch.*._x``) or patches a torch object.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SUPPORTED_TORCH = ("2.11", "2.13")  # lowest and highest minor version tested

# --- elastic agent, launcher, process helpers (torch.distributed.elastic / launcher) ---------------

# The stalwart agent subclasses TorchElastic's LocalElasticAgent and owns the supervision loop
# (``StalwartAgent._invoke_run``). It overrides these private methods; test_compat checks that the base
# class still has each one with these leading parameters (the override keeps the same call shape).
# ``_shutdown`` gained ``timeout`` in torch 2.13, so the override takes ``*args, **kwargs``.
AGENT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_invoke_run": ("self", "role"),
    "_initialize_workers": ("self", "worker_group"),
    "_start_workers": ("self", "worker_group"),
    "_stop_workers": ("self", "worker_group"),
    "_shutdown": ("self", "death_sig"),
}


def local_agent_kwargs(shutdown_timeout: int) -> dict[str, Any]:
    """Keyword arguments for ``LocalElasticAgent.__init__`` that this torch accepts: the grace period
    between SIGTERM and SIGKILL for workers (``shutdown_timeout``) is new in torch 2.13; 2.11 uses 30 s."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    params = inspect.signature(LocalElasticAgent.__init__).parameters
    return {"shutdown_timeout": shutdown_timeout} if "shutdown_timeout" in params else {}


def poll_workers(agent: Any, worker_group: Any) -> Any:
    """TorchElastic's check of the worker processes (``LocalElasticAgent._monitor_workers``): a
    ``RunResult`` with the group's state and each failed rank's ``ProcessFailure``."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return LocalElasticAgent._monitor_workers(agent, worker_group)


def exit_barrier(agent: Any) -> None:
    """Wait (bounded) for the other agents to finish too, as TorchElastic does after a success."""
    agent._exit_barrier()


def worker_processes(agent: Any) -> Any:
    """The running workers' process context (``pids()``, ``stderrs``), or None before the first start."""
    return agent._pcontext


def count_restart(agent: Any) -> int:
    """Count one restart of the worker group where TorchElastic reads it: it tells the workers
    ``TORCHELASTIC_RESTART_COUNT = max_restarts - _remaining_restarts``. stalwart's loop decides
    whether to restart (the master's job-wide budget); this only keeps the workers' count right.
    Returns the new restart count."""
    agent._remaining_restarts -= 1
    return agent.get_worker_group().spec.max_restarts - agent._remaining_restarts


def leave_rendezvous_round(handler: Any, timeout_s: float = 10.0) -> None:
    """Leave the current rendezvous round at once (TorchElastic has no public call for one node
    leaving): stop the keep-alive and run the handler's exit operation, as ``next_rendezvous`` does
    before it joins. Raises on a handler that has no such internals (e.g. static rendezvous)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler = getattr(handler, "inner", handler)  # stalwart's RoundStoreHandler wraps torch's
    handler._stop_heartbeats()
    handler._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + timeout_s)


def rendezvous_addr_and_port(params: Any) -> tuple[str | None, int | None]:
    """torchrun's MASTER_ADDR/MASTER_PORT for a rendezvous: from the endpoint for the static backend,
    (None, None) otherwise (the rendezvous picks them)."""
    from torch.distributed.launcher.api import _get_addr_and_port

    return _get_addr_and_port(params)


# Warm start (launch/zygote.py): torch.compile, torch.use_deterministic_algorithms and others import
# dynamo (0.5-3 s), so the zygote preloads it for scripts.
DYNAMO_MODULES = ("torch._dynamo",)


def join_non_daemon_threads() -> None:
    """Join the non-daemon threads as the interpreter does at exit (``threading._shutdown``): a forked
    worker that ends with ``os._exit`` would otherwise cut its threads off."""
    threading._shutdown()  # type: ignore[attr-defined]


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint (torch.distributed.checkpoint) -----------------------------------------


# --- end of distributed checkpoint section ----------------------------------------------------


# --- device mesh (torch.distributed.device_mesh) ---------------------------------------------

def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The axes ``dims`` of ``mesh`` as one axis called ``name`` (FSDP2/HSDP need "dp_shard" and "dp" as
    single axes). ``DeviceMesh._flatten`` is private in torch 2.11 and 2.13 (torchtitan relies on it too);
    same signature in both, so no version branch."""
    return mesh[dims]._flatten(name)


def slice_flattened(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """``mesh[dims]`` where some of ``dims`` were made by :func:`flatten_mesh` (HSDP's
    (dp_replicate, dp_shard) mesh). Torch 2.11 and 2.13 allow it with a deprecation warning and no
    public replacement; the warning is silenced here, and test_compat fails once torch removes it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mesh[dims]


# --- end of device mesh section ---------------------------------------------------------------


# --- training (determinism, activation checkpointing) --------------------------------------------


# --- end of training section ------------------------------------------------------------------
