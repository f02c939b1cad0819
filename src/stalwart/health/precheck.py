"""The node agent's own check before its workers start (``stalwart run --precheck``).

Before the first start and before every restart, the agent runs ``check.burn_in`` once per local
worker device (cuda:LOCAL_RANK, or the CPU) and compares each result with the float64 reference from
the same seed, so a node whose device computes wrong numbers, NaN or crashes never joins the
rendezvous. The paired collective rounds of ``stalwart check`` need peers in one world and are left
to that command: a precheck must stay cheap (well under a second on the debug sizes), since it sits
on the restart's critical path. Timings go to the master, which compares nodes (see ``master``).

Chaos makes a node bad for tests (``STALWART_CHAOS`` of the agent, see ``stalwart.chaos.faults``):
``node-fail`` (the burn-in raises, as a broken device does), ``nan:at=precheck`` (a wrong result),
``slow:at=precheck[:factor=F]`` (F× slower).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from stalwart import chaos
from stalwart.dist import cuda_devices
from stalwart.health.check import CheckConfig, Fault, burn_in, reference_product

POINT = "precheck"


@dataclass(frozen=True)
class PrecheckConfig:
    matmul_size: int = 384
    iters: int = 16  # the fastest counts (see check.burn_in); ~0.1 s per CPU device on a busy 2-core host
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.matmul_size < 8 or self.iters < 1:
            raise ValueError(f"precheck needs matmul_size ≥ 8 and iters ≥ 1 (got {self.matmul_size}, {self.iters})")


@dataclass
class PrecheckResult:
    ok: bool
    seconds: float  # wall time of the whole precheck
    matmul_s: float  # slowest local device's fastest matmul: what the master compares across nodes
    devices: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def local_devices(local_world_size: int) -> list[torch.device]:
    """The device each local worker will use: its own GPU when there are enough, else the CPU."""
    if cuda_devices() >= local_world_size:
        return [torch.device("cuda", i) for i in range(local_world_size)]
    return [torch.device("cpu")] * local_world_size


def _injected() -> Fault | None:
    """A chaos fault for this node's check, as ``check.burn_in`` understands faults (node 0 = us)."""
    fault = chaos.due(POINT)
    if fault is None:
        return None
    kind = {"node-fail": "node-fail", "nan": "nan", "delay": "slow"}[fault.action]  # chaos.parse checked it
    return Fault(kind, 0, fault.node_factor)


def run_precheck(local_world_size: int, cfg: PrecheckConfig | None = None) -> PrecheckResult:
    """Burn in every local device; never raises for a device fault (that is the verdict's job)."""
    cfg = cfg or PrecheckConfig()
    fault = _injected()
    check_cfg = CheckConfig(
        matmul_size=cfg.matmul_size,
        iters=cfg.iters,
        seed=cfg.seed,
        fault=fault if fault and fault.kind != "node-fail" else None,
    )
    start = time.perf_counter()
    # One BLAS thread: the agent shares the host with other agents and workers, and oversubscribed
    # threads would time the host's load (10× swings on a busy 2-core box), not the device.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _burn_in_all(local_world_size, check_cfg, fault)
    finally:
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - start
    return result


def _burn_in_all(local_world_size: int, check_cfg: CheckConfig, fault: Fault | None) -> PrecheckResult:
    reference = reference_product(check_cfg)
    result = PrecheckResult(True, 0.0, 0.0)
    for local_rank, device in enumerate(local_devices(local_world_size)):
        seconds: float | None
        try:
            if fault and fault.kind == "node-fail":
                raise RuntimeError("chaos node-fail: the device failed during the burn-in")
            ok, seconds = burn_in(check_cfg, device, 0, reference)
        except Exception as err:  # a broken device raises (CUDA error, ...): that is a failed check
            ok, seconds = False, None
            result.reasons.append(f"local rank {local_rank} ({device}): burn-in raised {type(err).__name__}: {err}")
        else:
            if not ok:
                result.reasons.append(
                    f"local rank {local_rank} ({device}): matmul result differs from the "
                    "seeded reference (wrong numbers or NaN)"
                )
        result.ok = result.ok and ok
        result.devices.append({"local_rank": local_rank, "device": str(device), "ok": ok, "matmul_s": seconds})
        if seconds is not None:
            result.matmul_s = max(result.matmul_s, seconds)
    return result
