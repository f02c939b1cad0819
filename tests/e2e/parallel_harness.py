"""Train a few steps under one parallel layout and write per-step losses (rank 0) as JSON.

    python tests/e2e/parallel_harness.py --layout none ...                 # 1-process reference, no
                                                                           # stalwart.train.parallel code
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/e2e/parallel_harness.py --layout tp=2 ...                    # any layout, or "auto"

Both paths build the same model with the same init, read the same global batches from the real data
pipeline (TokenDataset + GlobalSampler) and use AdamW with gradient clipping, so their losses must
agree to float tolerance. The reference path is deliberately plain PyTorch (gradient accumulation,
``clip_grad_norm_``), so a bug in the parallel library cannot hide in both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from stalwart.data import GlobalSampler, TokenDataset
from stalwart.models import build_model, model_args


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="prepared token directory")
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    p.add_argument("--model", default="debug")
    p.add_argument("--layout", default="none", help="none | auto | k=v,... (dp, dp_replicate, dp_shard, tp, pp, ep)")
    p.add_argument("--dp-mode", default="fsdp", choices=("ddp", "fsdp"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--layer-split", default="even")
    p.add_argument("--recompute", default="none")
    p.add_argument("--compress", default="none")
    p.add_argument("--alq-update-every", type=int, default=50)
    p.add_argument("--no-loss-parallel", action="store_true")
    p.add_argument("--no-pp-scatter-gather", action="store_true", help="PP×TP: send whole activations")
    p.add_argument("--fsdp-prefetch", type=int, default=1)
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save", help="DCP directory: save model + optimizer after the last step")
    p.add_argument("--load", help="DCP directory: restore model + optimizer (saved under any layout) first")
    p.add_argument("--start-step", type=int, default=0, help="steps already done (with --load)")
    p.add_argument(
        "--record-routing", action="store_true", help="MoE: tokens per expert and layer, each step (summed over ranks)"
    )
    return p.parse_args(argv)


def build_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )


def make_model(args: argparse.Namespace, vocab: int, meta: bool = False) -> torch.nn.Module:
    """The whole model initialised in memory (the reference), or on the meta device for ``parallelize``
    to materialise shard by shard: the curves agreeing checks that both give the same weights."""
    margs = model_args(args.model, vocab_size=vocab, max_seq_len=args.seq_len)
    if meta:
        with torch.device("meta"):
            return build_model(args.model, margs)
    model = build_model(args.model, margs)
    model.init_weights(args.seed)
    return model


class RoutingCounter:
    """Tokens each MoE layer's router sends to each expert in a step (top-k of its softmax, as the
    model routes), from forward hooks on the routers: two runs with equal counts routed alike. Top-k
    routing is discontinuous, so 1e-7 differences (another summation order) can flip a near-tie and
    part the curves; this tells such a step from a wrong result. No recompute: a re-run forward
    would count twice."""

    def __init__(self, model: torch.nn.Module) -> None:
        from stalwart.models.moe import moe_modules

        self.steps: list[list[list[int]]] = []
        self._counts: dict[int, torch.Tensor] = {}
        for i, moe in enumerate(moe_modules(model)):
            moe.router.register_forward_hook(self._hook(i, moe.num_experts, moe.top_k))

    def _hook(self, layer: int, experts: int, top_k: int):
        def hook(module, inputs, logits):
            ids = torch.topk(F.softmax(logits.detach().float(), dim=-1), top_k, dim=-1).indices
            counts = torch.bincount(ids.flatten(), minlength=experts)
            self._counts[layer] = self._counts.get(layer, 0) + counts

        return hook

    def end_step(self, group=None) -> None:
        counts = torch.stack([self._counts[k] for k in sorted(self._counts)]) if self._counts else torch.zeros(0)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=group)
        self.steps.append(counts.tolist())
        self._counts.clear()


def reference(args: argparse.Namespace, data: TokenDataset) -> dict:
    """One process, plain PyTorch: gradient accumulation over micro-batches of the global batch."""
    from stalwart.models.moe import set_aux_grad_scale

    model = make_model(args, data.vocab_size)
    routing = RoutingCounter(model) if args.record_routing else None
    opt = build_optimizer(list(model.parameters()), args.lr)
    sampler = GlobalSampler(len(data), args.global_batch, seed=1234)
    accum = args.global_batch // args.micro_batch
    set_aux_grad_scale(model, 1.0 / accum)
    losses, norms, times = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        inputs, targets = data.batch(sampler.next_batch(0, 1))
        total = 0.0
        for i in range(accum):
            sl = slice(i * args.micro_batch, (i + 1) * args.micro_batch)
            logits = model(inputs[sl])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[sl].flatten()) / accum
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.clip if args.clip > 0 else float("inf"), foreach=True
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(float(norm))
        times.append(time.perf_counter() - t0)
        if routing is not None:
            routing.end_step()
    result = {"layout": "none", "world_size": 1, "losses": losses, "grad_norms": norms, "step_times": times}
    return result | ({"routing": routing.steps} if routing is not None else {})


def save(module: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Plain DCP: sharded model and optimizer state under the unsplit model's names (the optimizer's
    flattened, per-parameter keys, as the trainer's checkpoints: pipeline stages never collide)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from stalwart.checkpoint.state import FLAT_OPTIM

    dcp.save(
        {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, opt, options=FLAT_OPTIM)},
        checkpoint_id=path,
    )


def restore(module: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """DCP load into this layout's shards (resharding from whatever layout saved it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from stalwart.checkpoint.state import FLAT_OPTIM

    state = {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, opt, options=FLAT_OPTIM)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, opt, state["optim"], options=FLAT_OPTIM)


def parse_layout(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        out[key.strip()] = int(value)
    return out


def parallel(args: argparse.Namespace, data: TokenDataset) -> dict:
    import torch.distributed as dist

    from stalwart.dist import init_distributed
    from stalwart.plan.auto import auto_layout
    from stalwart.plan.parallel import layout_from_config
    from stalwart.train.parallel import ParallelOptions, build_mesh, parallelize

    env = init_distributed("gloo")
    model = make_model(args, data.vocab_size, meta=True)
    why = ""
    micro_batch = args.micro_batch
    if args.layout == "auto":
        choice = auto_layout(
            model.args,
            env.world_size,
            args.seq_len,
            args.global_batch,
            moe=getattr(model, "moe_args", None),
            micro_batch=args.micro_batch,
        )
        layout, why = choice.layout, choice.why
        if env.rank == 0:
            print(why, file=sys.stderr)
    else:
        layout = layout_from_config(parse_layout(args.layout), env.world_size, args.dp_mode)
    mesh = build_mesh(layout)
    options = ParallelOptions(
        micro_batch=micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        layer_split=args.layer_split
        if not args.layer_split[0].isdigit()
        else tuple(int(c) for c in args.layer_split.split(",")),
        recompute=args.recompute,
        compress=args.compress,
        alq_update_every=args.alq_update_every,
        loss_parallel=not args.no_loss_parallel,
        pp_scatter_gather=not args.no_pp_scatter_gather,
        fsdp_prefetch=args.fsdp_prefetch,
        ddp_bucket_mb=args.ddp_bucket_mb,
    )
    pm = parallelize(model, layout, mesh, options, device=env.device, init_seed=args.seed)
    routing = RoutingCounter(pm.module) if args.record_routing else None  # every rank holds other rows
    opt = build_optimizer(list(pm.module.parameters()), args.lr)
    sampler = GlobalSampler(len(data), args.global_batch, seed=1234)
    if args.load:
        restore(pm.module, opt, args.load)
        sampler.consumed = args.start_step * args.global_batch
    losses, norms, times = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        inputs, targets = data.batch(sampler.next_batch(pm.dp_rank, pm.dp_size))
        loss = pm.forward_backward(inputs, targets)
        norm = pm.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        norms.append(float(norm))
        times.append(time.perf_counter() - t0)
        if routing is not None:
            routing.end_step(dist.group.WORLD)
    if args.save:
        save(pm.module, opt, args.save)
    # every rank must agree on the loss it reports
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, losses)
    sent = [None] * env.world_size  # bytes each rank's pipeline stages posted to isend (fwd, bwd)
    mine = (pm.pipeline.sent.forward, pm.pipeline.sent.backward) if pm.pipeline is not None else (0, 0)
    dist.all_gather_object(sent, mine)
    result = {
        "layout": layout.as_dict(),
        "describe": layout.describe(),
        "why": why,
        "world_size": env.world_size,
        "losses": losses,
        "grad_norms": norms,
        "step_times": times,
        "ranks_agree": all(g == losses for g in gathered),
        "uses_ddp": layout.uses_ddp,
        "pp_sent_bytes": sent,
    }
    if routing is not None:
        result["routing"] = routing.steps
    if args.compress == "alq":  # what the hook put on the wire, per step, and the buckets it saw
        result["hook_bytes"] = pm.hook_state.step_bytes
        result["bucket_numels"] = list(pm.hook_state.numels.values())
        result["params"] = sum(p.numel() for p in pm.module.parameters())
    # Let every rank's outstanding pipeline sends complete before gloo's threads are torn down
    # (destroying the group with unfinished P2P work aborts: "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = TokenDataset(args.data, args.seq_len)
    result = reference(args, data) if args.layout == "none" else parallel(args, data)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from stalwart.runtime import exit_process  # gloo may abort at interpreter finalization (see exit_process)

    exit_process(main())
