"""Expert parallelism for the MoE model: each EP rank owns ``num_experts / ep`` experts and tokens
travel to their experts' rank and back with two all-to-alls (GShard / torchtitan's design).

Applied from outside with ``distribute_module`` on every ``GroupedExperts``:

* partition: the batched expert weights become DTensors ``Shard(0)`` on the ``ep`` mesh axis;
* input: token rows arrive grouped by global expert id; the per-expert counts are exchanged, the
  rows are sent to the owning ranks (autograd-aware ``all_to_all_single``) and regrouped by local
  expert;
* output: the inverse permutation and the reverse all-to-all put results back in the order the
  router produced.

Gradient scaling: an expert's gradient sums the contributions of every data-parallel rank that
routed tokens to it, so FSDP must divide it by the full data-parallel degree rather than by its own
(smaller) shard group; :func:`expert_fsdp_divide_factor` gives that number.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from stalwart.models.moe import GroupedExperts


class _ExpertParallel:
    """Per-module dispatch/combine state (one forward at a time; pipeline micro-batches run each
    module's forward to completion before the next)."""

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.mesh = mesh
        self.ep = mesh.size()
        self.num_experts = num_experts
        self.local = num_experts // self.ep
        self._saved: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def dispatch(self, module: nn.Module, inputs: Any, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        x, counts = inputs
        group = mesh.get_group()
        # recv[r, j] = rows that rank r sends to this rank's local expert j
        recv = funcol.all_to_all_single(counts, None, None, group)
        recv = funcol.wait_tensor(recv) if hasattr(funcol, "wait_tensor") else recv
        send_splits = counts.view(self.ep, self.local).sum(1).tolist()
        recv_table = recv.view(self.ep, self.local)
        recv_splits = recv_table.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x, recv_splits, send_splits, group)
        rows = funcol.wait_tensor(rows) if hasattr(funcol, "wait_tensor") else rows
        # Received order is (source rank, local expert); regroup as (local expert, source rank).
        starts = torch.cumsum(recv_table.flatten(), 0) - recv_table.flatten()
        pieces = []
        for j in range(self.local):
            for r in range(self.ep):
                n = int(recv_table[r, j])
                if n:
                    s = int(starts[r * self.local + j])
                    pieces.append(torch.arange(s, s + n, device=x.device))
        perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=x.device)
        self._saved.append((perm, send_splits, recv_splits))
        return rows.index_select(0, perm), recv_table.sum(0)

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        perm, send_splits, recv_splits = self._saved.pop()
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        rows = out.index_select(0, inverse)
        back = funcol.all_to_all_single_autograd(rows, send_splits, recv_splits, mesh.get_group())
        return funcol.wait_tensor(back) if hasattr(funcol, "wait_tensor") else back


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard every ``GroupedExperts`` of ``model`` over ``ep_mesh``; returns how many."""
    n = 0
    for module in list(model.modules()):
        if isinstance(module, GroupedExperts):
            if module.num_experts % ep_mesh.size():
                raise ValueError(f"ep={ep_mesh.size()} must divide the expert count {module.num_experts}")
            style = _ExpertParallel(ep_mesh, module.num_experts)
            distribute_module(module, ep_mesh, style.partition, style.dispatch, style.combine)
            n += 1
    return n


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def expert_fsdp_divide_factor(dp_replicate: int, dp_shard: int) -> float:
    """Experts see tokens from all dp ranks: divide their summed gradient by the whole dp degree."""
    return float(dp_replicate * dp_shard)
