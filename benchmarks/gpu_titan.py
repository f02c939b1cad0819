"""torchtitan's own trainer as the baseline of benchmarks/gpu_step.py: its llama3 model and train loop
(``torchtitan.train.Trainer``: AdamW fused, bf16 autocast on one GPU, no activation checkpointing, no
compile) on the benchmark's shape, batch and steps, offline. One JSON line on stdout.

    python benchmarks/gpu_titan.py --dim 1024 --n-layers 24 --n-heads 16 --n-kv-heads 8 --ffn-hidden 2816 \
        --vocab 257 --seq-len 2048 --micro-batch 8 --global-batch 16 --warmup 3 --steps 15

Offline: the batches are synthetic token ids (speed does not depend on their values), and the train
spec registered here has no tokenizer and no HF dataset; ``datasets`` and ``tensorboard`` are only
imported by code this run never calls (the HF text loader, the disabled TensorBoard logger), so when
they are absent (the GPU image lacks both) empty stand-ins take their place. Written for torchtitan
0.2.2 (the release nearest torch 2.11; docs/gpu.md says how to carry it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
import types
from collections.abc import Iterator
from importlib.util import find_spec


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "ffn-hidden", "vocab", "seq-len"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15, help="timed steps, after --warmup")
    p.add_argument("--out", default="/tmp/stalwart-titan", help="torchtitan's dump folder")
    return p.parse_args(argv)


def missing(name: str) -> bool:
    return name not in sys.modules and find_spec(name) is None


def stand_ins() -> list[str]:
    """Empty modules for the imports torchtitan makes but this run never uses; returns their names."""
    made = []
    if missing("datasets"):  # torchtitan.hf_datasets.text_datasets: the HF text loader only
        ds = types.ModuleType("datasets")
        ds.Dataset = ds.IterableDataset = type("Unused", (), {})
        ds.load_dataset = ds.interleave_datasets = lambda *a, **k: None
        dist = types.ModuleType("datasets.distributed")
        dist.split_dataset_by_node = lambda *a, **k: None
        ds.distributed = dist
        sys.modules.update({"datasets": ds, "datasets.distributed": dist})
        made.append("datasets")
    if missing("tensorboard"):  # torchtitan.components.metrics: the (disabled) TensorBoard logger
        tb = types.ModuleType("torch.utils.tensorboard")
        tb.SummaryWriter = type("SummaryWriter", (), {})
        sys.modules["torch.utils.tensorboard"] = tb
        made.append("tensorboard")
    return made


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_config(a: argparse.Namespace, spec_name: str):  # -> torchtitan.config.JobConfig
    """The benchmark's settings on torchtitan's JobConfig (its defaults otherwise)."""
    from torchtitan.config import JobConfig

    c = JobConfig()
    c.job.dump_folder = a.out
    c.model.name, c.model.flavor = spec_name, "bench"
    c.training.local_batch_size = a.micro_batch
    c.training.global_batch_size = a.global_batch  # > local: gradient accumulation, as in stalwart
    c.training.seq_len = a.seq_len
    c.training.steps = a.warmup + a.steps
    c.training.mixed_precision_param = "bfloat16"  # one GPU, no FSDP: torch.autocast(bf16), as stalwart
    c.activation_checkpoint.mode = "none"  # stalwart's default (recompute=none); torchtitan's is selective
    c.compile.enable = False
    c.checkpoint.enable = False
    c.lr_scheduler.warmup_steps = 1
    c.metrics.log_freq = a.warmup + a.steps  # its own log line at the last step only
    c.metrics.disable_color_printing = True
    return c


def ffn_width(dim: int, ffn_hidden: int) -> dict[str, float | int]:
    """torchtitan's arguments that give a SwiGLU width of exactly ``ffn_hidden``: its FeedForward takes
    int(2/3 · 4·dim), scales it by ffn_dim_multiplier, rounds up to multiple_of; a multiplier that lands
    one below ``ffn_hidden`` and multiple_of = ``ffn_hidden`` round it to that width, whatever the rule."""
    return {"ffn_dim_multiplier": (ffn_hidden - 0.5) / int(2 * 4 * dim / 3), "multiple_of": ffn_hidden}


def register(a: argparse.Namespace) -> str:
    """A train spec: torchtitan's llama3 everything, with this shape and synthetic batches, no tokenizer."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import register_train_spec

    class Synthetic(BaseDataLoader):
        """Random token ids, made once: the loader costs nothing, as stalwart's prefetched batches."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.rows = torch.randint(0, a.vocab, (4, a.micro_batch, a.seq_len + 1), generator=g)

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            i = 0
            while True:
                row = self.rows[i % len(self.rows)]
                yield {"input": row[:, :-1]}, row[:, 1:]
                i += 1

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    base = llama3.get_train_spec()
    args = llama3.TransformerModelArgs(
        dim=a.dim,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        vocab_size=a.vocab,
        rope_theta=500000.0,
        **ffn_width(a.dim, a.ffn_hidden),
    )
    spec = dataclasses.replace(
        base,
        model_args={"bench": args},
        build_dataloader_fn=lambda **kw: Synthetic(),
        build_tokenizer_fn=None,
        build_validator_fn=None,
        state_dict_adapter=None,
    )
    register_train_spec("stalwart_bench", spec)
    return "stalwart_bench"


def measure(a: argparse.Namespace) -> dict:
    stubs = stand_ins()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch
    import torchtitan
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    first, last = a.warmup + 1, a.warmup + a.steps
    marks: dict[str, float] = {}

    class Timed(Trainer):
        """Wall time of the timed steps, one device sync at each end (none per step)."""

        def train_step(self, data_iterator: Iterator) -> None:
            if self.step == first:
                torch.cuda.synchronize()
                marks["t0"] = time.perf_counter()
            super().train_step(data_iterator)
            if self.step == last:
                torch.cuda.synchronize()
                marks["t1"] = time.perf_counter()

    trainer = Timed(job_config(a, register(a)))
    try:
        n_params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        fpt = trainer.metrics_processor.num_flops_per_token
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    step_s = (marks["t1"] - marks["t0"]) / a.steps
    return {
        "name": f"torchtitan {getattr(torchtitan, '__version__', '?')} Trainer (llama3)",
        "step_s": step_s,
        "step_s_is": f"mean of the {a.steps} steps after {a.warmup} warm-up steps",
        "n_params": n_params,
        "torchtitan_flops_per_token": fpt,
        "stand_ins": stubs,
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(parse(argv))), flush=True)


if __name__ == "__main__":
    main()
