"""Every private PyTorch API stalwart relies on, in one place.

Supported torch range: see ``SUPPORTED_TORCH`` (pyproject.toml pins the tested bounds). Each
reach-in below has a test in ``tests/unit/test_compat.py`` that fails loudly when torch changes it,
so a torch upgrade breaks one module and one test file, not the agent or the checkpoint at run time.
Nothing outside this module imports a private torch name (``torch.*._x``) or patches a torch object.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
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


def rendezvous_round(handler: Any) -> int | None:
    """The round of the rendezvous that just completed (TorchElastic's dynamic rendezvous keeps it in
    its shared state, so every node of one execution reads the same integer, and every restart or
    regrouping is a later round); None for other rendezvous (static)."""
    holder = getattr(getattr(handler, "inner", handler), "_state_holder", None)
    state = getattr(holder, "state", None)
    round_ = getattr(state, "round", None)
    return round_ if isinstance(round_, int) else None


def rendezvous_node(handler: Any) -> list[Any] | None:
    """This agent's identity in TorchElastic's dynamic rendezvous ([addr, pid, local_id]), told to the
    master at join so that peers can expire it when it is lost; None for other rendezvous."""
    node = getattr(getattr(handler, "inner", handler), "_this_node", None)
    return None if node is None else [node.addr, node.pid, node.local_id]


def expire_rendezvous_nodes(handler: Any, nodes: list[list[Any]], attempts: int = 5) -> int:
    """Mark ``nodes`` ([addr, pid, local_id], from ``rendezvous_node``) dead in the shared rendezvous
    state now, as their keep-alive would after ``keep_alive_interval × keep_alive_max_attempt``: their
    last heartbeat is set to the epoch and written back (compare-and-set, retried when another node
    wrote first). Every node's next sync then drops them (TorchElastic's own ``_sanitize``), so a round
    a lost node belonged to closes without waiting. Returns how many were found and marked."""
    import datetime

    wanted = {tuple(n) for n in nodes}
    epoch = datetime.datetime.fromtimestamp(0, datetime.UTC)

    def mark(state: Any) -> int | None:
        found = [n for n in state.last_heartbeats if (n.addr, n.pid, n.local_id) in wanted]
        for n in found:
            state.last_heartbeats[n] = epoch
        return len(found) if found else None

    found = _update_rendezvous_state(getattr(handler, "inner", handler), mark, attempts)
    return found if found is not None else 0


def _update_rendezvous_state(inner: Any, change: Callable[[Any], Any], attempts: int) -> Any:
    """Apply ``change`` to the shared rendezvous state and write it back, compare-and-set as torch's own
    ops write, retried when another node wrote first. ``change`` returns None to write nothing (that
    None is returned), else the result returned once the write won; None after ``attempts`` lost
    writes. Under the handler's heartbeat lock: its keep-alive thread syncs the same state."""
    holder = inner._state_holder
    with inner._heartbeat_lock:
        for _ in range(attempts):
            holder.sync()
            if (result := change(holder.state)) is None:
                return None
            holder.mark_dirty()
            if holder.sync():
                return result
    return None


def waiting_nodes_that_fit(handler: Any, attempts: int = 5) -> int:
    """TorchElastic's ``num_nodes_waiting``, less the nodes that cannot join because the round already
    holds ``max_nodes``. torch puts a node that arrives at a full round in the redundancy list, but a
    node already in the wait list when the next round fills without it stays there, so the members see
    a waiting node, restart for it, and the round refills without one of three again: a regroup storm
    (216 restarts in 97 s, three nodes with ``--nnodes 1:2``). Such nodes are moved to the redundancy
    list here (compare-and-set, as torch's own ops write), where torch keeps them, without the join
    timeout, until a member leaves (as it keeps a node that arrived at a full round). Under the
    handler's heartbeat lock, as torch's count: its keep-alive thread syncs the same state. After
    ``attempts`` lost writes: 0 for this tick (the next one counts again)."""
    inner = getattr(handler, "inner", handler)
    if not hasattr(inner, "_state_holder"):  # not torch's dynamic rendezvous (static): its own count
        return inner.num_nodes_waiting()
    max_nodes, counted = inner._settings.max_nodes, []

    def park(state: Any) -> int | None:
        if not state.wait_list or not state.complete or len(state.participants) < max_nodes:
            counted.append(len(state.wait_list))
            return None
        state.redundancy_list.update(state.wait_list)
        state.wait_list.clear()
        return 0

    parked = _update_rendezvous_state(inner, park, attempts)
    return counted[0] if parked is None and counted else 0


def rendezvous_addr_and_port(params: Any) -> tuple[str | None, int | None]:
    """torchrun's MASTER_ADDR/MASTER_PORT for a rendezvous: from the endpoint for the static backend,
    (None, None) otherwise (the rendezvous picks them)."""
    from torch.distributed.launcher.api import _get_addr_and_port

    return _get_addr_and_port(params)


def rendezvous_poll(max_nodes: int) -> float:
    """Make a dynamic rendezvous that waits for other nodes look again every ``min(1, max(0.05,
    max_nodes / 100))`` seconds instead of torch's second: it sleeps a fixed second between polls
    (``_Action.SYNC``: ``_delay(seconds=1)``) and its state holder answers from a cache for a second
    (``cache_duration=1``), so the node that reached a restart's round first joined up to ~1 s after the
    last one — what a job across nodes lost per recovery against one node. The holder's cache also
    paces the agent's ``num_nodes_waiting`` every monitor tick, so the store's load (each read is the
    whole O(nodes) state) stays at most a hundred reads a second below 100 nodes, and torch's own from
    there on. Its random skew of a round's first join (``_delay(seconds=(0, 0.3))``, there to spread
    thousands of nodes' first calls; it also delays every restart's round, 0.15 s on average) is
    scaled the same way: torch's 0.3 s from 1,000 nodes, 0.3 ms for one. Returns the interval; idempotent."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    poll_s = min(1.0, max(0.05, max_nodes / 100))
    skew = min(1.0, max_nodes / 1000)
    delay = getattr(dr._delay, "__wrapped__", dr._delay)
    holder_init = getattr(dr._BackendRendezvousStateHolder.__init__, "__wrapped__", None)
    holder_init = holder_init or dr._BackendRendezvousStateHolder.__init__

    def polled(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # the first join's random skew
            delay((seconds[0] * skew, seconds[1] * skew))
        else:
            delay(poll_s if seconds == 1 else seconds)  # the SYNC wait is the only one of exactly a second

    def init(self: Any, backend: Any, settings: Any, cache_duration: float = 1) -> None:
        holder_init(self, backend, settings, min(cache_duration, poll_s))

    polled.__wrapped__ = delay  # type: ignore[attr-defined]
    init.__wrapped__ = holder_init  # type: ignore[attr-defined]
    dr._delay = polled
    dr._BackendRendezvousStateHolder.__init__ = init
    return poll_s


def quick_agent_paths(tail_interval_s: float = 0.02) -> None:
    """Take two fixed costs out of every restart of a worker group (idempotent):
    - the dynamic rendezvous names each of its logged events by ``inspect.stack()`` (``get_method_name``),
      which resolves the source file of every frame against every imported module: ~0.2 s of a
      restart's round in an agent that has imported torch (measured, benchmarks/recovery.py). A
      frame's own code object names the same method;
    - a failed worker's group is closed only once the threads teeing its logs have seen their stop
      flag, and they look every ``interval_sec`` (0.1 s: up to 0.1 s of detection); they look every
      ``tail_interval_s`` instead (a sleep and an empty read per rank and stream)."""
    from torch.distributed.elastic.multiprocessing import tail_log
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    def method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # the stack is shallower than ``depth``: torch's own answer then
            return "no_method_name"

    if not hasattr(dr.get_method_name, "__wrapped__"):
        method_name.__wrapped__ = dr.get_method_name  # type: ignore[attr-defined]
        dr.get_method_name = method_name
    init = getattr(tail_log.TailLog.__init__, "__wrapped__", tail_log.TailLog.__init__)

    def tail_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) < 5:  # (name, log_files, dst, log_line_prefixes, interval_sec): not given
            kwargs.setdefault("interval_sec", tail_interval_s)
        init(self, *args, **kwargs)

    tail_init.__wrapped__ = init  # type: ignore[attr-defined]
    tail_log.TailLog.__init__ = tail_init


# Warm start (launch/zygote.py): torch.compile, torch.use_deterministic_algorithms and others import
# dynamo (0.5-3 s), so the zygote preloads it for scripts.
DYNAMO_MODULES = ("torch._dynamo",)


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint (torch.distributed.checkpoint) -----------------------------------------


# DCP's shard writers open every file through an internal ``fs`` object (``create_stream``); its
# flattening of nested state dicts, the fsspec reader/writer and the storage records of a shard are
# private modules/classes. Identical in torch 2.11 and 2.13 (checked with both), so no version branch.


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """DCP's own flattening (``_nested_dict.flatten_state_dict``): the keys ``dcp.save``/``dcp.load``
    derive from a nested dict, and each key's path in it. A checkpoint's keys must be exactly these."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def _fsspec_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def checkpoint_writer(path: str, *, local: bool, wrap_fs: Callable[[Any], Any], **kwargs: Any) -> Any:
    """A DCP ``FileSystemWriter`` (``local``) or ``FsspecWriter`` whose internal file system (the
    ``fs`` attribute through which ``write_data``/``finish`` open every stream) is ``wrap_fs(fs)``:
    stalwart sums each shard's bytes as they pass, instead of reading the files back."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    base = FileSystemWriter if local else _fsspec_classes()[0]
    writer = base(path, **kwargs)
    writer.fs = wrap_fs(writer.fs)
    return writer


def join_checkpoint_writer_threads(timeout_s: float) -> list[str]:
    """Wait for DCP's extra writer threads (``FileSystemWriter(thread_count>1)`` starts threads running
    ``_write_files_from_queue``; when the calling thread's own share fails — a full disk — it raises
    without joining them, and they go on reading tensors). Returns the names of those still running."""
    import threading

    stray = [t for t in threading.enumerate() if "_write_files_from_queue" in t.name and t.is_alive()]
    for t in stray:
        t.join(timeout_s)
    return [t.name for t in stray if t.is_alive()]


def checkpoint_reader(path: str, *, local: bool, read_metadata: Callable[[], Any], **kwargs: Any) -> Any:
    """A DCP ``FileSystemReader`` (``local``) or ``FsspecReader`` that takes its ``.metadata`` from
    ``read_metadata()`` (stalwart's restricted unpickler) instead of ``pickle.load``; it stamps the
    reader's ``load_id`` on it as DCP's own ``read_metadata`` does."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    base = FileSystemReader if local else _fsspec_classes()[1]

    class _Reader(base):  # type: ignore[valid-type, misc]
        def read_metadata(self, *args: Any, **kw: Any) -> Any:
            md = read_metadata()
            if getattr(md, "storage_meta", None) is not None:
                md.storage_meta.load_id = self.load_id
            return md

    return _Reader(path, **kwargs)


def storage_info_fields(info: Any) -> dict[str, Any]:
    """The fields of a shard's storage record (``filesystem._StorageInfo``, a ``WriteResult``'s
    ``storage_data``) as JSON-able values, for sending write results between nodes."""
    return {
        "path": info.relative_path,
        "at": info.offset,
        "length": info.length,
        "transforms": list(info.transform_descriptors or []) or None,
    }


def storage_info(fields: dict[str, Any]) -> Any:
    """The inverse of :func:`storage_info_fields`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(fields["path"], fields["at"], fields["length"], fields["transforms"])


def storage_prefix(prefix: str) -> Any:
    """A rank's file-name prefix in a global save plan (``filesystem._StoragePrefix``)."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    return _StoragePrefix(prefix)


# ``.metadata`` pickles storage records by this (module, class name): the restricted unpickler allows it.
STORAGE_INFO_CLASS = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    _CHECKPOINT_PREFIX as CHECKPOINT_WRAPPER_PREFIX,  # noqa: F401
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402, F401


def set_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` without its import of ``torch._inductor`` (only to
    set inductor's own flag; 2–3 s of every worker start, so of every recovery, on torch 2.13). The
    trainer does not compile; if something already imported inductor, the public call is used.

    Without filling uninitialized memory (``torch.utils.deterministic.fill_uninitialized_memory``, on by
    default with deterministic algorithms): a fill of every ``torch.empty`` that only makes a faulty
    op's read of garbage repeatable, at ~3 % of a CPU step here (issue 28 item 0); torch's docs call a
    valid program deterministic without it."""
    import torch
    import torch.utils.deterministic

    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=False)
    else:
        torch._C._set_deterministic_algorithms(True, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = False


def sdpa_backend(
    q: Any, k: Any, v: Any, attn_mask: Any = None, is_causal: bool = False, enable_gqa: bool = False
) -> str:
    """The backend ``F.scaled_dot_product_attention`` dispatches these inputs to (flash_attention,
    efficient_attention, cudnn_attention, math; the CPU has its own flash kernel): torch's own choice
    function, the one the eager call runs."""
    import torch
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=None, enable_gqa=enable_gqa)
    return SDPBackend(choice).name.lower()


def ddp_without_buffer_sync() -> dict[str, bool]:
    """DDP's keyword for "no buffer broadcast in every forward": ``forward_sync_buffers=False`` where
    torch has it (2.13 deprecates ``broadcast_buffers`` with a FutureWarning at every start; the new one
    still syncs buffers once at init), ``broadcast_buffers=False`` before (2.11)."""
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def own_members(module: Any) -> tuple[Any, Any, Any]:
    """A module's direct children, parameters and buffers (``None`` entries included), read from its
    own dicts: ``named_children``/``named_parameters(recurse=False)`` build names and dedupe, and the
    snapshot's cache key reads 200+ modules at every save (checkpoint/state.py)."""
    return module._modules.values(), module._parameters.values(), module._buffers.values()


# --- end of training section ------------------------------------------------------------------


# --- flight recorder (hang diagnosis) ----------------------------------------------------------------
def flight_recorder_dump() -> dict[str, Any]:
    """This process's PyTorch Flight Recorder ring (every process group's recent collectives with their
    sequence ids, ops, shapes and whether each finished; on by default, gloo included) as a dict:
    ``{"entries": [...], "pg_status": {...}, ...}``. The private ``_dump_fr_trace_json`` is the only
    reader torch has; its ``pg_config`` is empty on gloo, so callers name groups themselves."""
    import json

    from torch._C._distributed_c10d import _dump_fr_trace_json

    return json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))


# --- end of flight recorder section -----------------------------------------------------------------


# -- FSDP2 asynchronous unshard (explicit prefetch off CUDA) ----------------------------------------
def fsdp_async_unshard(module: Any) -> None:
    """``FSDPModule._set_unshard_async_op(True)`` (private in torch 2.13): pre-forward/backward and
    prefetched all-gathers return their work and are waited for where the parameters are needed."""
    module._set_unshard_async_op(True)


# -- async tensor parallelism (CUDA) ----------------------------------------------------------------
def enable_async_tp(group_name: str) -> None:
    """Inductor's micro-pipeline TP pass (private flag ``_micro_pipeline_tp``) plus symmetric memory
    for the TP group: needed explicitly up to torch 2.12, deprecated ("no need to call") from 2.13."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    inductor_config._micro_pipeline_tp = True
    enable = _symmetric_memory.enable_symm_mem_for_group
    if not getattr(enable, "__deprecated__", None):
        enable(group_name)


# -- many copies in one call -------------------------------------------------------------------------
def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """``dst[i].copy_(src[i])`` for all i through ``torch._foreach_copy_`` (private): one call instead
    of a Python loop, which costs microseconds per tensor on the host (a snapshot's device → host copies:
    hundreds of tensors per save). Falls back to the loop where the op refuses the lists."""
    import torch

    if not dst:
        return
    try:
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)
    except (RuntimeError, TypeError, NotImplementedError):
        for d, t in zip(dst, src, strict=True):
            d.copy_(t, non_blocking=non_blocking)
