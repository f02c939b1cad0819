"""The sections of benchmarks/gpu_step.py: the device's peak, the plain-loop baseline, `stalwart train`
runs (plain, a snapshot every step, SIGKILL + restore), the torchtitan baseline. Each returns a dict
of figures; a subprocess that outlives ``timeout`` is killed with its process group."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE_MODEL = "llama3-8b"  # LLaMA-style registry entry whose shape the overrides replace
TITAN_WHEEL = "torchtitan==0.2.2"  # the release nearest torch 2.11 (docs/gpu.md: how to carry it)
# gpu_step's default on CUDA, sized so it takes ~2 minutes on an H100 (docs/gpu.md): ~280M parameters,
# dim 1024, 24 layers, GQA 16/8, SwiGLU 2816 (the LLaMA rule), on the byte corpus's 257 tokens.
SHAPES = {
    "280m": {"dim": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 2816},
    "1b": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 8192},  # Llama-3.2-1B blocks
    "tiny": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 256},
}
RUN_KEYS = ("shape", "seq_len", "micro_batch", "global_batch", "warmup", "steps")  # a benchmark's defaults, in order


class SectionError(RuntimeError):
    """A section failed; its message goes into the JSON instead of a traceback."""


def add_run_arguments(p: argparse.ArgumentParser, gpu_shape: str, each: str) -> None:
    """The options both GPU benchmarks take: output, --smoke, the peak, the model shape and batch, steps."""
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out-json", default="", help=f"also write the JSON here, rewritten after each {each}")
    p.add_argument("--smoke", action="store_true", help="the CPU, a tiny shape and few steps: runs every line")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak to divide by (a fake one on the CPU)")
    p.add_argument("--shape", choices=sorted(SHAPES), help=f"model shape (default {gpu_shape}; smoke: tiny)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--warmup", type=int, help="steps not timed, per run")
    p.add_argument("--steps", type=int, help="timed steps per run, after --warmup")
    p.add_argument("--work", default="", help="directory for data and runs (default: a temporary one)")


def fill_run_defaults(p: argparse.ArgumentParser, a: argparse.Namespace, defaults: tuple) -> None:
    """Fill what the command line left open from ``defaults`` (in ``RUN_KEYS`` order); resolve the shape."""
    for key, value in zip(RUN_KEYS, defaults):
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.global_batch % a.micro_batch:
        p.error("--global-batch must be a multiple of --micro-batch")
    a.shape_name, a.shape = a.shape, SHAPES[a.shape]


def chosen(p: argparse.ArgumentParser, given: str, known: tuple[str, ...], what: str) -> list[str]:
    """The comma-separated subset ``given`` of ``known``; a usage error names the unknown ones."""
    names = [n for n in given.split(",") if n]
    if unknown := set(names) - set(known):
        p.error(f"unknown {what} {sorted(unknown)}; known: {', '.join(known)}")
    return names


def run_header(a: argparse.Namespace, prefix: str) -> tuple[dict, Path, Path]:
    """(the result's header: device, model, batch, peak; the work directory; the corpus) for a run."""
    import torch

    from stalwart.data import ensure_default_corpus
    from stalwart.models import meta_param_count, model_args

    work = Path(a.work or tempfile.mkdtemp(prefix=prefix))
    data = ensure_default_corpus(work / "data")
    a.vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    n_params = meta_param_count(model_args(BASE_MODEL, vocab_size=a.vocab, max_seq_len=a.seq_len, **a.shape))
    peak, device_name, peak_source = peak_flops(a.device, a.peak_tflops)
    header = {
        "device": device_name,
        "torch": torch.__version__,
        "model": {"base": BASE_MODEL, "shape": a.shape_name, **a.shape, "n_params": n_params},
        "seq_len": a.seq_len,
        "global_batch": a.global_batch,
        "micro_batch": a.micro_batch,
        "warmup": a.warmup,
        "steps": a.steps,
        "peak_flops": peak,
        "peak_source": peak_source,
        "work": str(work),
    }
    return header, work, data


def writer(path: str) -> Callable[[dict], None]:
    """Rewrite ``path`` atomically with the result so far (partial results survive a kill)."""

    def emit(r: dict) -> None:
        if path:
            tmp = f"{path}.tmp"
            Path(tmp).write_text(json.dumps(r, indent=1, default=str))
            os.replace(tmp, path)

    return emit


def peak_flops(device: str, override_tflops: float) -> tuple[float, str, str]:
    """(bf16 dense peak FLOP/s, device name, where the peak came from); 0 when unknown (no MFU)."""
    import torch

    from stalwart.plan.hardware import GPUS

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if override_tflops > 0:
        return override_tflops * 1e12, name, "--peak-tflops"
    if device != "cuda":
        return 0.0, name, "none: pass --peak-tflops"
    low = name.lower().replace(" ", "")
    if "a100" in low:
        big = torch.cuda.get_device_properties(0).total_memory > 50 * 2**30
        key = "a100-80g" if big else "a100-40g"
    else:
        key = next((k for k in sorted(GPUS, key=len, reverse=True) if k in low), "")
    if not key:
        return 0.0, name, f"none: {name!r} is not in stalwart.plan.hardware.GPUS; pass --peak-tflops"
    return GPUS[key].peak_flops, name, f"stalwart.plan.hardware.GPUS[{key!r}] ({GPUS[key].source})"


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run in its own process group; on timeout kill the whole group (no orphan holds the GPU)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SectionError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:5])} ...") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise SectionError(f"{' '.join(proc.args[:5])} ... failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return proc


def train_cmd(a: argparse.Namespace, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stalwart",
        "train",
        "--config",
        "configs/debug.toml",
        f"--model.name={BASE_MODEL}",
        *(f"--model.{k}={v}" for k, v in a.shape.items()),
        f"--data.dir={data}",
        f"--data.seq_len={a.seq_len}",
        f"--train.steps={steps}",
        f"--train.global_batch={a.global_batch}",
        f"--train.micro_batch={a.micro_batch}",
        "--train.warmup_steps=0",
        "--train.deterministic=false",  # the plain loop does not pay for determinism either
        f"--train.log_every={10**6}",
        f"--train.out_dir={out}",
        # the device follows the machine (docs/gpu.md): gloo puts a rank on the CPU even beside a GPU;
        # one thread, as the plain loop: on a shared CPU, idle-spinning OpenMP threads swamp a tiny model
        *(["--parallel.backend=gloo", "--train.threads=1"] if a.device == "cpu" else []),
        "--json",
        *extra,
    ]


def records(out: Path, skip: int) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if len(rows) <= skip:
        raise SectionError(f"{out}: {len(rows)} steps logged, none after the {skip} warm-up steps")
    return rows[skip:]


def plain_model(shape: dict, vocab: int, seq_len: int, dev: str) -> tuple[Any, list, Any]:
    """The baseline's model (``build_model``, seeded), its parameters and fused AdamW (on CUDA)."""
    import torch

    from stalwart.models import build_model, model_args

    torch.manual_seed(0)
    model = build_model(BASE_MODEL, model_args(BASE_MODEL, vocab_size=vocab, max_seq_len=seq_len, **shape)).to(dev)
    model.init_weights(0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev == "cuda")
    return model, params, opt


def plain_step(model: Any, params: list, opt: Any, micro_batches: list, dev: str) -> None:
    """One step of the bare loop: bf16 autocast on CUDA, the loss averaged over the micro-batches
    (tokens and next tokens in one row each), grad clipping, the optimizer step."""
    import torch
    import torch.nn.functional as F

    for mb in micro_batches:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(mb[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / len(micro_batches)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)


def plain_loop(a: argparse.Namespace, data: Path) -> dict:
    """The baseline: the same model and batch in a bare loop (no DDP, no hooks, no checkpoints)."""
    import numpy as np
    import torch

    dev, cuda = a.device, a.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # as `stalwart train` gets here (train_cmd)
    index = json.loads((data / "index.json").read_text())
    tokens = np.concatenate([np.memmap(data / s["file"], dtype=index["dtype"], mode="r") for s in index["shards"]])
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    model, params, opt = plain_model(a.shape, vocab, a.seq_len, dev)
    n_micro = a.global_batch // a.micro_batch
    n_seq = (len(tokens) - 1) // a.seq_len
    if n_seq <= a.global_batch:
        raise SectionError(f"the corpus holds {n_seq} sequences of {a.seq_len}: fewer than a batch")
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        start = (step * a.global_batch) % (n_seq - a.global_batch)
        rows = np.stack(
            [tokens[(start + i) * a.seq_len : (start + i + 1) * a.seq_len + 1] for i in range(a.global_batch)]
        )
        batch = torch.from_numpy(rows.astype(np.int64)).to(dev, non_blocking=True)
        plain_step(model, params, opt, list(batch.split(a.micro_batch)[:n_micro]), dev)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in params)
    del model, opt, params
    if cuda:
        torch.cuda.empty_cache()
    return {"name": "plain PyTorch loop", "step_s": statistics.median(times[a.warmup :]), "n_params": n_params}


def stalwart_plain(a: argparse.Namespace, data: Path, work: Path) -> dict:
    """`stalwart train`, 1 rank, checkpoints off: the medians of its logged step times."""
    out = work / "stalwart"
    checked(run(train_cmd(a, data, out, a.warmup + a.steps), a.section_timeout))
    rows = records(out, a.warmup)
    return {"name": "stalwart train", "step_s": statistics.median(r["step_time_s"] for r in rows)}


def ckpt_flags(a: argparse.Namespace, out: Path) -> list[str]:
    return [
        "--checkpoint.enabled=true",
        f"--checkpoint.dir={out / 'checkpoints'}",
        f"--checkpoint.shm_dir={a.shm_dir}",
        "--checkpoint.memory_every=1",
        "--checkpoint.persist_every_steps=0",  # memory only: persisting is the keeper's, off the step's path
    ]


def too_little_shm(proc: subprocess.CompletedProcess, a: argparse.Namespace) -> dict | None:
    if proc.returncode != 0 and "memory snapshots need" in proc.stderr:  # too little tmpfs: say why
        from stalwart.checkpoint.slot_file import shm_free_bytes

        return {"skipped": proc.stderr.strip().splitlines()[-1], "shm_free_bytes": shm_free_bytes(Path(a.shm_dir))}
    return None


def snapshot_every_step(a: argparse.Namespace, data: Path, work: Path, plain_step_s: float | None) -> dict:
    """Host blocking per save with a memory snapshot every step: the save call (metrics
    ``checkpoint_s``, median over the timed steps) plus the optimizer hook's waits (the run's total
    over its steps: the only other place a step waits for a snapshot; the run's final wait for its last
    snapshot is not a step's and is reported apart), against the median step."""
    out = work / "ckpt"
    proc = run(train_cmd(a, data, out, a.warmup + a.steps, *ckpt_flags(a, out)), a.section_timeout)
    skipped = too_little_shm(proc, a)
    if skipped:
        return skipped
    checked(proc)
    summary = json.loads((out / "summary.json").read_text())
    ck, rows = summary["checkpoint"], records(out, a.warmup)
    step_s = statistics.median(r["step_time_s"] for r in rows)
    save_s = statistics.median(r["checkpoint_s"] for r in rows)
    hook_s = ck["hook_wait_s"] / summary["steps"]
    blocking = save_s + hook_s
    result = {
        "step_s": step_s,
        "save_call_ms": save_s * 1e3,
        "hook_wait_ms_per_step": hook_s * 1e3,
        "end_wait_ms": ck["end_wait_s"] * 1e3,  # once, at the run's end
        "blocking_ms_per_save": blocking * 1e3,
        "blocking_fraction": blocking / step_s,
        "blocking_target": 0.01,
        "snapshots": ck["snapshots"],
        "snapshots_skipped": ck["snapshots_skipped"],
    }
    if plain_step_s:  # what the copy costs the step beyond the host blocking (D2H traffic, contention)
        result["step_vs_no_checkpoint"] = step_s / plain_step_s
    return result


def restore_after_kill(a: argparse.Namespace, data: Path, work: Path) -> dict:
    """A short checkpointed run SIGKILLed (chaos) after its step 2, then restarted: it restores that
    snapshot from shared memory (the summary's ``restore_s``)."""
    out = work / "restore"
    chaos = {"STALWART_CHAOS": "kill:step=2", "STALWART_CHAOS_DIR": str(work / "chaos")}
    killed = run(train_cmd(a, data, out, 4, *ckpt_flags(a, out)), a.section_timeout, env=chaos)
    skipped = too_little_shm(killed, a)
    if skipped:
        return skipped
    if killed.returncode == 0:
        raise SectionError("the run was not killed by chaos (kill:step=2): nothing to restore")
    t0 = time.perf_counter()
    checked(run(train_cmd(a, data, out, 4, *ckpt_flags(a, out)), a.section_timeout))
    restart_s = time.perf_counter() - t0
    ck = json.loads((out / "summary.json").read_text())["checkpoint"]
    return {
        "killed_rc": killed.returncode,
        "restored_from": ck["restored_from"],
        "restore_step": ck["restore_step"],
        "restore_s": ck["restore_s"],
        "restart_wall_s": restart_s,  # the whole restarted process: start, restore, 2 steps, exit
    }


def titan_importable() -> str | None:
    """None when torchtitan can be imported here, else why not."""
    try:
        spec = find_spec("torchtitan")
    except (ImportError, ValueError) as e:
        return f"torchtitan cannot be found: {e}"
    if spec is None:
        return (
            f"torchtitan is not importable: carry {TITAN_WHEEL} and its pure-Python deps as wheels "
            "(docs/gpu.md, 'Running it on a lent GPU machine')"
        )
    return None


def torchtitan(a: argparse.Namespace, work: Path) -> dict:
    """torchtitan's Trainer on the same shape, batch and steps (benchmarks/gpu_titan.py), or why not."""
    why = titan_importable()
    if why:
        return {"skipped": why}
    if a.device != "cuda":
        return {"skipped": "torchtitan's Trainer needs CUDA (it sets a CUDA device and builds a CUDA mesh)"}
    s = a.shape
    cmd = [
        sys.executable,
        str(HERE / "gpu_titan.py"),
        *(f"--{k.replace('_', '-')}={v}" for k, v in s.items()),
        f"--vocab={a.vocab}",
        f"--seq-len={a.seq_len}",
        f"--micro-batch={a.micro_batch}",
        f"--global-batch={a.global_batch}",
        f"--warmup={a.warmup}",
        f"--steps={a.steps}",
        f"--out={work / 'torchtitan'}",
    ]
    proc = checked(run(cmd, a.section_timeout))
    (work / "torchtitan.log").write_text(proc.stdout + proc.stderr)  # torchtitan logs to stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"name": "torchtitan')]
    if not lines:
        raise SectionError(f"benchmarks/gpu_titan.py printed no result: {proc.stderr[-1500:]}")
    return json.loads(lines[-1])
