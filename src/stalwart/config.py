"""Typed run configuration: TOML file + dotted command-line overrides, with per-field checks.

    stalwart train --config configs/debug.toml --train.steps 50 --parallel.dp_mode fsdp

Every mistake (unknown key, wrong type, out-of-range value) raises ``ValueError`` with a message that
says what to change. A leaf module: it imports nothing of stalwart. What depends on the world size
and the model (layout, batch split) is checked by ``stalwart.train.resolve.resolve``, before any
process is started.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    name: str = "debug"  # a name from stalwart.models.SPECS
    # Optional overrides of the named shape (0 / "" = keep the registry's value).
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn_hidden: int = 0
    tie_embeddings: bool = False
    # Techniques that change the arithmetic, off by default (docs/techniques.md).
    parallel_block: bool = False  # x + attn(norm(x)) + mlp(norm(x)): one TP reduction per block
    attn_window: int = 0  # sliding-window attention over the last W tokens (0 = full causal)
    embed_norm: bool = False  # LayerNorm after the embedding (BLOOM's StableEmbedding)


@dataclass
class DataConfig:
    dir: str = "data/prepared/stdlib-byte"  # prepared token directory
    prepare_default: bool = True  # prepare the stdlib corpus into `dir` if it is missing
    seq_len: int = 128
    seed: int = 1234  # sampler order
    shuffle: bool = True
    # Stream positions never served, "START:STOP,..." (half-open). Reproduces a guard rollback's skip:
    # summary.json guard.skip_samples of the rolled-back run is the value to copy here.
    skip_samples: str = ""
    # Batches read (and moved to the device) ahead by a background thread while the step runs; 0 = read
    # in the step. The samples and their order are the same whatever the value (stalwart.data.prefetch).
    prefetch: int = 2


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, fixed whatever the world size
    micro_batch: int = 4  # sequences per forward/backward on one rank
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 0  # model init
    deterministic: bool = True
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    threads: int = 0  # intra-op threads per rank; 0 = cores / local ranks
    log_every: int = 10
    out_dir: str = "runs/debug"
    peak_flops: float = 0.0  # per device, FLOP/s; enables MFU in metrics (0 = unknown)
    rank_records: bool = True  # every rank writes OUT_DIR/ranks/rank{R}.jsonl (docs/observe.md)
    flight_dumps: bool = True  # under `stalwart run`: answer the agent's Flight Recorder requests on a hang
    compile: bool = False  # torch.compile each transformer block (stalwart.train.compile)
    tensorboard: str = "auto"  # rank 0's metrics as OUT_DIR/tensorboard events: auto (if installed) | on | off


@dataclass
class OptimConfig:
    """Which optimizer; its hyperparameters (lr, betas, eps, weight_decay) stay in [train]."""

    name: str = "adamw"  # adamw | lamb (layer-wise trust ratio, You et al. 2019: large global batches)


@dataclass
class ParallelConfig:
    """Parallel layout (docs/parallelism.md). Degrees multiply to the world size; 0 = not given."""

    layout: str = "manual"  # manual (the degrees below) | auto (the planner's fastest layout that fits)
    dp: int = 0  # data-parallel degree; 0 = the ranks left after tp × pp. Meaning set by dp_mode
    dp_replicate: int = 0  # explicit HSDP: replicas (instead of dp)
    dp_shard: int = 0  # explicit HSDP: FSDP2 shards per replica (instead of dp)
    tp: int = 1  # tensor (+ sequence) parallel
    pp: int = 1  # pipeline stages (ranks)
    ep: int = 1  # expert parallel (MoE models; carved out of the FSDP2 shards)
    dp_mode: str = "ddp"  # ddp (dp = replicas: DDP, or HSDP with tp/pp) | fsdp (dp = FSDP2 shards)
    reshard_after_forward: bool = True  # FSDP2: True ≈ ZeRO-3, False ≈ ZeRO-2
    schedule: str = "1f1b"  # pp > 1: 1f1b | interleaved_1f1b | gpipe
    virtual_stages: int = 1  # stages per pipeline rank (≥ 2 with interleaved_1f1b)
    layer_split: str = "even"  # even | lighter_ends | layers per stage, e.g. "1,2,1"
    recompute: str = "none"  # none | selective | full
    recompute_every: int = 1  # full recompute on every k-th block only
    loss_parallel: bool = True  # tp > 1: cross-entropy on vocabulary-sharded logits
    compress: str = "none"  # gradient compression: none | bf16 | fp16 | powersgd | alq (DDP only)
    powersgd_rank: int = 1
    alq_bits: int = 4  # compress = "alq": bits per gradient value (sign + level index): 2 | 4 | 8
    alq_update_every: int = 50  # compress = "alq": steps between refits of the quantization levels
    fsdp_prefetch: int = 1  # FSDP2: each block prefetches the next N blocks' all-gathers (0 = implicit only)
    ddp_bucket_mb: float = 25.0  # DDP: gradient bucket MB; full buckets all-reduce during the backward
    async_tp: bool = False  # tp > 1 on CUDA with compiled blocks: micro-pipelined TP collectives
    pp_scatter_gather: bool = True  # pp, tp > 1: a stage sends its 1/tp slice (false: the whole activation)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    cpu_offload: bool = False  # FSDP2 only: sharded parameters, gradients and optimizer state on the host

    def degrees(self) -> dict[str, int]:
        """The degrees as ``layout_from_config`` takes them (dp, dp_replicate, dp_shard: 0 = not given)."""
        given = {k: getattr(self, k) for k in ("dp", "dp_replicate", "dp_shard") if getattr(self, k)}
        return {**given, "tp": self.tp, "pp": self.pp, "ep": self.ep}


@dataclass
class CheckpointConfig:
    enabled: bool = False  # flash checkpoints (memory snapshots + persistence); see docs/checkpoint.md
    dir: str = ""  # local path or fsspec URL (s3://bucket/prefix); "" = <train.out_dir>/checkpoints
    memory_every: int = 1  # shared-memory snapshot every N steps
    persist_every_steps: int = 50  # persist to `dir` every N steps (0 = off); a multiple of memory_every
    persist_every_s: float = 0.0  # also persist the newest snapshot every S seconds (0 = off)
    keep_last: int = 3  # committed checkpoints to keep
    keep_every: int = 0  # also keep every step divisible by this (0 = none)
    shm_dir: str = ""  # tmpfs for the snapshots (2 x the state free); "" = $STALWART_SHM_DIR or /dev/shm
    keeper_idle_s: float = 120.0  # the keeper exits after this long without live workers
    # A job that ended with storage lacking its newest snapshot (preemption, SIGTERM, memory-only) keeps
    # them in shm_dir this long for a requeue; then the next job on the node or `stalwart ckpt gc` removes them
    keep_shm_s: float = 21600.0
    resume: bool = True  # restore at start (false: start over; `dir` must hold no committed checkpoint;
    # a worker restarted within the launch still resumes its own run)
    # While storage fails, training goes on from memory until this much work since the last commit is
    # at risk; then the job stops with an error naming the shared-memory copy (0 = no bound)
    max_unpersisted_steps: int = 0
    max_unpersisted_s: float = 1800.0

    def validate(self) -> None:
        for key in ("memory_every", "keep_last"):
            if getattr(self, key) < 1:
                raise ValueError(f"checkpoint.{key} must be ≥ 1, got {getattr(self, key)}")
        for key in (
            "persist_every_steps",
            "persist_every_s",
            "keep_every",
            "max_unpersisted_steps",
            "max_unpersisted_s",
        ):
            if getattr(self, key) < 0:
                raise ValueError(f"checkpoint.{key} must be ≥ 0 (0 = off), got {getattr(self, key)}")
        if self.persist_every_steps % self.memory_every:
            raise ValueError(
                f"checkpoint.persist_every_steps={self.persist_every_steps} must be a multiple of "
                f"checkpoint.memory_every={self.memory_every} (only snapshotted steps can be persisted)"
            )
        if self.keeper_idle_s <= 0:
            raise ValueError(f"checkpoint.keeper_idle_s must be positive, got {self.keeper_idle_s}")
        if self.keep_shm_s < 0:
            raise ValueError(
                f"checkpoint.keep_shm_s must be ≥ 0 (0: an ended job's snapshots expire at once), got {self.keep_shm_s}"
            )


@dataclass
class GuardConfig:
    """Training-health guard (docs/guard.md): judge each step before the update, roll back on a bad one."""

    enabled: bool = False  # needs checkpoint.enabled (a rollback restores a checkpoint)
    window: int = 50  # healthy steps in the median/MAD baseline
    warmup_steps: int = 20  # steps that only feed the baseline (spikes are not judged; NaN always is)
    loss_k: float = 6.0  # loss spike: loss > median + loss_k · MAD
    grad_k: float = 10.0  # gradient-norm spike: norm > median + grad_k · MAD (0 = do not judge norms)
    rollback_steps: int = 100  # restore the newest checkpoint at least this many steps before the bad one
    skip_batches: int = 200  # global batches skipped from the restored position
    max_rollbacks: int = 3  # more than this within `per_steps` steps stops the run
    per_steps: int = 1000
    sdc_check: bool = True  # on NaN/Inf, run the matmul burn-in on every rank (silent data corruption)

    def validate(self, ckpt: CheckpointConfig) -> None:
        if not self.enabled:
            return
        for key in ("window", "rollback_steps", "max_rollbacks", "per_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"guard.{key} must be ≥ 1, got {getattr(self, key)}")
        if self.window < 5:
            raise ValueError(f"guard.window must be ≥ 5 steps (a median needs a few), got {self.window}")
        for key in ("warmup_steps", "skip_batches"):
            if getattr(self, key) < 0:
                raise ValueError(f"guard.{key} must be ≥ 0, got {getattr(self, key)}")
        if self.loss_k <= 0 or self.grad_k < 0:
            raise ValueError(f"guard.loss_k must be > 0 and guard.grad_k ≥ 0 (got {self.loss_k}, {self.grad_k})")
        if not ckpt.enabled:
            raise ValueError(
                "guard.enabled needs checkpoint.enabled=true: a rollback restores a checkpoint "
                "(set --checkpoint.enabled=true, or --guard.enabled=false)"
            )
        problem = rollback_reach_problem(self.rollback_steps, ckpt)
        if problem:
            raise ValueError(problem)


def rollback_reach_problem(rollback_steps: int, ckpt: CheckpointConfig) -> str | None:
    """Why the checkpoint policy cannot always offer a state ≥ `rollback_steps` before a bad step,
    or None. Memory keeps the two newest snapshots (the older is memory_every + 1 steps back at
    least); storage keeps the newest keep_last of every persist_every_steps-th step."""
    r, m, p = rollback_steps, ckpt.memory_every, ckpt.persist_every_steps
    if r <= m + 1:
        return None
    if p and ckpt.keep_last >= -(-(r - 1) // p) + 1:
        return None
    need = -(-(r - 1) // p) + 1 if p else None
    fix = (
        f"checkpoint.keep_last ≥ {need} (now {ckpt.keep_last})"
        if p
        else "checkpoint.persist_every_steps > 0 with enough checkpoint.keep_last"
    )
    return (
        f"guard.rollback_steps={r} needs a checkpoint at least {r} steps before any step, but memory "
        f"snapshots reach back only checkpoint.memory_every + 1 = {m + 1} steps; set {fix}, or "
        f"guard.rollback_steps ≤ {m + 1}"
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check values that types alone do not: choices, signs, ranges, and the checkpoint and guard
        sections. The layout (degrees × world size × model × batch split) is checked where it is
        planned, by ``stalwart.train.resolve.resolve``."""
        t, d, p = self.train, self.data, self.parallel
        _choice("parallel.layout", p.layout, ("manual", "auto"))
        _choice("parallel.dp_mode", p.dp_mode, ("ddp", "fsdp"))
        _choice("parallel.backend", p.backend, ("auto", "gloo", "nccl"))
        _choice("train.dtype", t.dtype, ("auto", "float32", "bfloat16"))
        _choice("train.tensorboard", t.tensorboard, ("auto", "on", "off"))
        _choice("optim.name", self.optim.name, ("adamw", "lamb"))
        if self.model.attn_window < 0:
            raise ValueError(f"model.attn_window must be ≥ 0 (0 = full causal attention), got {self.model.attn_window}")
        for key, value in (
            ("train.steps", t.steps),
            ("train.global_batch", t.global_batch),
            ("train.micro_batch", t.micro_batch),
            ("data.seq_len", d.seq_len),
            ("train.log_every", t.log_every),
            ("parallel.alq_update_every", p.alq_update_every),
        ):
            if value <= 0:
                raise ValueError(f"{key} must be positive, got {value}")
        if p.alq_bits not in (2, 4, 8):
            raise ValueError(f"parallel.alq_bits must be 2, 4 or 8 (whole codes per byte), got {p.alq_bits}")
        if d.prefetch < 0:
            raise ValueError(f"data.prefetch must be ≥ 0 (global batches read ahead; 0 = off), got {d.prefetch}")
        if not 0 <= t.warmup_steps <= t.steps:
            raise ValueError(f"train.warmup_steps={t.warmup_steps} must be within [0, train.steps={t.steps}]")
        if t.lr <= 0 or not 0 <= t.min_lr <= t.lr:
            raise ValueError(f"need 0 < train.lr and 0 ≤ train.min_lr ≤ train.lr (got {t.lr}, {t.min_lr})")
        if p.fsdp_prefetch < 0:
            raise ValueError(
                f"parallel.fsdp_prefetch must be ≥ 0 (0 = FSDP2's implicit prefetch), got {p.fsdp_prefetch}"
            )
        if p.ddp_bucket_mb <= 0:
            raise ValueError(f"parallel.ddp_bucket_mb must be positive, got {p.ddp_bucket_mb}")
        self.checkpoint.validate()
        self.guard.validate(self.checkpoint)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _coerce(key: str, value: Any, target: type) -> Any:
    """Convert a TOML value or a CLI string to the field's type, or explain why not."""
    origin = typing.get_origin(target)
    if origin in (typing.Union, types.UnionType):
        target = next(a for a in typing.get_args(target) if a is not type(None))
    if isinstance(value, str) and target is not str:
        text = value.strip()
        if target is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(f"{key} expects true/false, got {value!r}")
        try:
            return target(float(text)) if target is int and "e" in text.lower() else target(text)
        except ValueError:
            raise ValueError(f"{key} expects {target.__name__}, got {value!r}") from None
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if target is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, target) or (target is int and isinstance(value, bool)):
        raise ValueError(f"{key} expects {target.__name__}, got {type(value).__name__} {value!r}")
    return value


def _unknown(kind: str, name: str, known: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"
    return ValueError(f"unknown {kind} {name!r}{hint}")


def _apply(cfg: Config, dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(Config)}
    if section not in sections or not key:
        raise _unknown("config key", dotted, [f"{s}.<key>" for s in sorted(sections)])
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if key not in hints:
        raise _unknown("config key", dotted, [f"{section}.{k}" for k in hints])
    setattr(obj, key, _coerce(dotted, value, hints[key]))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults ← TOML file ← overrides (dotted keys)."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path}: invalid TOML: {err}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _apply(cfg, f"{section}.{key}", value)
    for dotted, value in (overrides or {}).items():
        _apply(cfg, dotted, value)
    return cfg


def parse_overrides(args: list[str]) -> dict[str, str]:
    """['--train.steps', '5', '--data.seq_len=64'] → {'train.steps': '5', 'data.seq_len': '64'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ValueError(f"override {arg} needs a value")
            key, value = arg[2:], args[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out
