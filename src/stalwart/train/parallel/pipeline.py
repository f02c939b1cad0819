"""Pipeline parallelism with ``torch.distributed.pipelining``: stage splitting, stage modules,
1F1B / interleaved 1F1B / GPipe schedules, and a train step that returns the loss on every rank.

Splitting follows torchtitan: every rank builds the whole model on the meta device (no memory), then
keeps only its stages' blocks, materialised after the other parallelisms are applied. Each stage is
a :class:`StageModule` that *references* the kept submodules under their original names
(``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``), so TP, recompute and FSDP apply to it
exactly as to the whole model. The pruned original model (blocks of other ranks
deleted) stays the object to build the optimizer on and to checkpoint: its parameter names are the
unsplit model's, which is what lets DCP restore a PP checkpoint without PP and back.

With ``virtual_stages = v`` a rank holds v stages, ``rank, rank + pp, ...`` (the "loop" placement of
Narayanan et al. 2021), which is what ``ScheduleInterleaved1F1B`` expects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from stalwart.models.llama import embed, rope_tables
from stalwart.train.parallel.pp_boundary import SentBytes

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")


# -- how many layers each stage gets --------------------------------------------------------------
def split_layers(
    n_layers: int, n_stages: int, layer_split: str | Sequence[int] = "even", end_weight: float = 1.0
) -> list[int]:
    """Layers per stage, in stage order.

    ``"even"``: as equal as possible (earlier stages take the remainder). ``"lighter_ends"``: the
    first and last stage also carry the embedding and the LM head, counted as ``end_weight`` layers
    each, so they get fewer blocks (GLM-130B's split). A sequence gives the counts explicitly.
    """
    if n_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got {n_stages}")
    if n_stages > n_layers:
        raise ValueError(
            f"{n_stages} pipeline stages (pp × virtual_stages) but only {n_layers} layers: "
            f"every stage needs at least one layer; lower pp or virtual_stages"
        )
    if not isinstance(layer_split, str):
        counts = [int(c) for c in layer_split]
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(
                f"layer_split={list(layer_split)} must give {n_stages} positive counts that sum to {n_layers} layers"
            )
        return counts
    if layer_split == "even":
        return [n_layers // n_stages + (1 if i < n_layers % n_stages else 0) for i in range(n_stages)]
    if layer_split != "lighter_ends":
        raise ValueError(f"layer_split={layer_split!r} must be 'even', 'lighter_ends' or a list of counts")
    if end_weight < 0:
        raise ValueError(f"end_weight must be ≥ 0, got {end_weight}")
    extra = [0.0] * n_stages
    extra[0] += end_weight
    extra[-1] += end_weight
    # Smallest bound T on a stage's cost (layers + extra) that fits all layers; then trim.
    candidates = sorted({k + e for k in range(1, n_layers + 1) for e in set(extra)})
    for bound in candidates:
        caps = [max(1, math.floor(bound - e + 1e-9)) for e in extra]
        if sum(caps) >= n_layers:
            break
    counts = caps
    while sum(counts) > n_layers:
        # take a layer from the most loaded stage that can spare one (ends first on ties)
        order = sorted(range(n_stages), key=lambda i: (-(counts[i] + extra[i]), -extra[i]))
        i = next(i for i in order if counts[i] > 1)
        counts[i] -= 1
    return counts


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stage indices held by ``pp_rank`` (loop placement)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def stage_layers(
    n_layers: int, pp: int, virtual_stages: int, layer_split: str | Sequence[int] = "even"
) -> list[list[int]]:
    """Global layer indices of every stage, in stage order."""
    counts = split_layers(n_layers, pp * virtual_stages, layer_split)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


# -- stage modules ----------------------------------------------------------------------------------
class StageModule(nn.Module):
    """One pipeline stage of a Transformer: embedding (first stage), a run of blocks, final norm and
    head (last stage). Attribute names match the Transformer's so parallel plans apply unchanged."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.args = model.args
        self.tok_embeddings = model.tok_embeddings if first else None
        self.pos_embeddings = model.pos_embeddings if first else None
        self.embed_norm = model.embed_norm if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        if model.rope is not None:
            self.register_buffer("rope", model.rope, persistent=False)
        else:
            self.rope = None

    def init_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty``; this stage holds its own buffer)."""
        if self.rope is not None and self.rope.device.type != "meta":
            a = self.args
            with torch.no_grad():
                self.rope.copy_(rope_tables(a.head_dim, a.max_seq_len, a.rope_theta))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = embed(self, h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def split_model(
    model: nn.Module, pp_rank: int, pp: int, virtual_stages: int = 1, layer_split: str | Sequence[int] = "even"
) -> tuple[list[int], list[StageModule]]:
    """Prune ``model`` in place to this rank's stages and return (stage ids, stage modules)."""
    n_stages = pp * virtual_stages
    layers = stage_layers(model.args.n_layers, pp, virtual_stages, layer_split)
    ids = stage_ids(pp_rank, pp, virtual_stages)
    stages = [StageModule(model, layers[s], first=s == 0, last=s == n_stages - 1) for s in ids]
    keep = {str(i) for s in ids for i in layers[s]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if 0 not in ids:
        model.tok_embeddings = None
        if getattr(model, "pos_embeddings", None) is not None:
            model.pos_embeddings = None
        if getattr(model, "embed_norm", None) is not None:
            model.embed_norm = None
    if n_stages - 1 not in ids:
        if model.args.tie_embeddings:
            raise ValueError(
                "pipeline parallelism with tied embeddings is not supported (the embedding "
                "and the head live on different stages); set model.tie_embeddings = false"
            )
        model.norm = None
        model.output = None
    return ids, stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- schedule and step ------------------------------------------------------------------------------
def check_microbatches(schedule: str, n_microbatches: int, pp: int) -> None:
    """Raise ValueError when ``schedule`` cannot run ``n_microbatches`` per step over ``pp`` ranks."""
    if schedule == "1f1b" and n_microbatches < pp:
        raise ValueError(
            f"1F1B needs at least pp={pp} micro-batches per step, got {n_microbatches}: "
            f"lower micro_batch or raise the batch per data-parallel rank"
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(
                f"interleaved 1F1B needs micro-batches ({n_microbatches}) divisible by "
                f"{rounds} rounds; use a multiple of pp={pp}"
            )


class PipelineRunner:
    """Builds the stages and schedule once per micro-batch count and runs one step."""

    def __init__(
        self,
        stages: list[StageModule],
        ids: list[int],
        n_stages: int,
        pp_mesh: DeviceMesh,
        device: torch.device,
        schedule: str = "1f1b",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
        if len(stages) > 1 and schedule != "interleaved_1f1b":
            raise ValueError(f"virtual_stages > 1 needs schedule='interleaved_1f1b', got {schedule!r}")
        self.modules, self.ids, self.n_stages = stages, ids, n_stages
        self.pp_mesh, self.device, self.kind, self.loss_fn = pp_mesh, device, schedule, loss_fn
        self.group = pp_mesh.get_group()
        self.has_first = 0 in ids
        self.has_last = n_stages - 1 in ids
        self._schedule: _PipelineSchedule | None = None
        self._n_microbatches = 0
        self.on_loss: Callable[[torch.Tensor], torch.Tensor] | None = None  # the step's loss hook; set per step
        self.sent = SentBytes()  # bytes posted to isend by this rank's stages (benchmarks, tests)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        return loss if self.on_loss is None else self.on_loss(loss)

    def schedule(self, n_microbatches: int) -> _PipelineSchedule:
        # Imported here: torch.distributed.pipelining imports torch._dynamo (~1 s of every worker start,
        # every recovery included), which jobs without a pipeline never need.
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if self._schedule is not None and n_microbatches == self._n_microbatches:
            return self._schedule
        check_microbatches(self.kind, n_microbatches, self.pp_mesh.size())
        stages = [
            PipelineStage(m, i, self.n_stages, self.device, group=self.group) for m, i in zip(self.modules, self.ids)
        ]
        for stage in stages:
            self.sent.watch(stage)
        if self.kind == "interleaved_1f1b":
            sched: _PipelineSchedule = ScheduleInterleaved1F1B(
                stages, n_microbatches, loss_fn=self._loss, scale_grads=True
            )
        elif self.kind == "1f1b":
            sched = Schedule1F1B(stages[0], n_microbatches, loss_fn=self._loss, scale_grads=True)
        else:
            sched = ScheduleGPipe(stages[0], n_microbatches, loss_fn=self._loss, scale_grads=True)
        self._schedule, self._n_microbatches = sched, n_microbatches
        return sched

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        n_microbatches: int,
        on_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward + backward of this data-parallel rank's batch; gradients are the mean over
        micro-batches. Returns the mean micro-batch loss, identical on every stage (0-dim fp32; a
        broadcast from the last stage, asynchronous to the host). ``on_loss`` transforms each
        micro-batch loss where it is computed (the last stage) before its backward."""
        sched = self.schedule(n_microbatches)
        self.on_loss = on_loss
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        sched.step(*args, return_outputs=False, **kwargs)
        if self.has_last:
            loss = torch.stack([t.detach().float() for t in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        src = dist.get_global_rank(self.group, self.pp_mesh.size() - 1)
        dist.broadcast(loss, src=src, group=self.group)
        return loss
