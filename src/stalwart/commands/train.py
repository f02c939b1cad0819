"""`stalwart train`: the LLaMA-style trainer, single process, `--nproc N` local workers, or under
torchrun / `stalwart run`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from stalwart.commands.common import emit
from stalwart.runtime import ENV_PARENT_REPORTS, exit_process, worker_env

EPILOG = """\
config overrides:
  Any config key can be set as --section.key VALUE (or --section.key=VALUE), e.g.
    --train.steps 50 --train.global_batch 32 --parallel.dp_mode fsdp --data.seq_len 256
  Sections: model, data, train, parallel, checkpoint, guard (see configs/debug.toml for every key;
  layouts: docs/parallelism.md).

examples:
  stalwart train --config configs/debug.toml                 # one process
  stalwart train --config configs/debug.toml --nproc 2       # two local workers (DDP over gloo)
  stalwart train --nproc 4 --parallel.dp_mode fsdp --parallel.tp 2    # FSDP2 x TP2 (2-D mesh)
  stalwart train --nproc 2 --parallel.pp 2 --parallel.schedule interleaved_1f1b --parallel.virtual_stages 2
  stalwart train --nproc 2 --model.name debug-moe --parallel.dp_mode fsdp --parallel.ep 2
  stalwart train --nproc 4 --parallel.layout auto             # the planner picks (and explains) the layout
  torchrun --nproc-per-node 2 -m stalwart train --config configs/debug.toml
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a LLaMA-style model (DDP, FSDP2, TP+SP, PP, MoE EP, or an auto layout)",
        description="Train a LLaMA-style decoder on prepared token data under any parallel layout of the "
        "[parallel] section: DDP or FSDP2/HSDP data parallel, tensor + sequence parallel, "
        "pipeline stages (1F1B, interleaved 1F1B, GPipe), MoE expert parallel, combined on one "
        "device mesh, or parallel.layout=auto (the planner's choice). Under a launcher (torchrun, "
        "stalwart run) it uses the launcher's environment; otherwise --nproc N spawns N "
        "local workers. Metrics go to OUT_DIR/metrics.jsonl, the summary to OUT_DIR/summary.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="TOML config file (default: built-in debug config)")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes when not under a launcher")
    p.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    p.set_defaults(handler=run, accepts_overrides=True)


def _strip(argv: list[str], flag: str, takes_value: bool) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = takes_value
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def train(
    config: Path | None, overrides: dict[str, Any], nproc: int = 1, worker_argv: list[str] | None = None
) -> dict[str, Any] | None:
    """Run training and return the summary (None on non-zero ranks under a launcher)."""
    from stalwart.config import load_config
    from stalwart.dist import launched

    cfg = load_config(config, overrides)
    if launched() or nproc == 1:  # this process trains: its Trainer resolves the plan, once
        return _train_worker(cfg)
    from stalwart.data import ensure_default_corpus
    from stalwart.dist import cuda_devices, pick_device
    from stalwart.launch.local import spawn_local
    from stalwart.train.resolve import resolve

    plan = resolve(cfg, nproc)  # every mistake fails here, before a worker is spawned
    backend, device = pick_device(cfg.parallel.backend, cuda_devices(), 0, nproc)
    plan.layout.check_device(backend, device.type)

    if cfg.data.prepare_default:
        ensure_default_corpus(cfg.data.dir)
    spawn_local(nproc, ["train", *(worker_argv or [])], env={ENV_PARENT_REPORTS: "1"})  # the parent prints the summary
    return json.loads((Path(cfg.train.out_dir) / "summary.json").read_text())


def _train_worker(cfg) -> dict[str, Any] | None:
    from stalwart.dist import init_distributed, shutdown
    from stalwart.train.trainer import Trainer
    from stalwart.utils.phases import Phases

    phases = Phases()
    env = init_distributed(cfg.parallel.backend)
    phases.mark("init_distributed")  # CUDA's context and the process group (NCCL's communicator)
    try:
        trainer = Trainer(cfg, env, phases)
    except BaseException:
        shutdown()
        raise
    try:
        summary = trainer.fit()
    except Exception:
        # A failed worker leaves at once: interpreter teardown with torch loaded, and a process group
        # whose peers wait in a collective, take seconds, which an agent would first see as a hang.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    shutdown()
    return summary if env.is_main else None


def run(args: argparse.Namespace, overrides: dict[str, Any], raw_argv: list[str]) -> int:
    worker_argv = _strip(_strip(raw_argv, "--nproc", True), "--json", False)
    summary = train(args.config, overrides, args.nproc, worker_argv)
    if summary is not None and not worker_env().parent_reports:
        emit(summary, args.json, "training summary")
    if worker_env().launched or args.nproc == 1:  # this process trained: it used a process group
        exit_process(0)
    return 0
