"""Does stalwart cost GPU throughput? `stalwart train` vs a plain PyTorch loop on the same model and
batch, one GPU, bf16, plus what flash checkpoints cost there, in one run.

    python benchmarks/gpu_step.py [--json] [--steps 30]      # needs CUDA: a ~1B LLaMA-style model, seq 2048
    python benchmarks/gpu_step.py --smoke --json             # tiny shape on the CPU: checks the plumbing only

Measured (medians over the steps after ``--warmup``):
- tokens/s and MFU of `stalwart train` (1 rank, checkpoints off) and of the plain loop (same
  ``build_model``, AdamW, grad clipping, bf16 autocast, the same micro-batches); MFU = 6·N + attention
  FLOPs per token (stalwart.plan.compute) × tokens/s / the GPU's bf16 peak (stalwart.plan.hardware);
- checkpoint blocking per save with a memory snapshot every step: the trainer's ``checkpoint_s`` (the
  save call) plus the optimizer hook's waits, as a fraction of the median step time;
- restore-from-memory time: a short checkpointed run is SIGKILLed (chaos) after its step 2, and a
  restart restores that snapshot from shared memory (the summary's ``restore_s``).
torchtitan is used as the baseline only if importable *and* wired here: it is not yet (reported as such).
Targets (issue 17): blocking ≤ 1 % of a step; stalwart MFU ≥ 0.95 × the plain loop's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ~1B: Llama-3.2-1B's blocks (dim 2048, 16 layers, GQA 32/8, ffn 8192) on the byte corpus's 257 tokens.
FULL = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 8192}
SMOKE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128}
BASE_MODEL = "llama3-8b"  # LLaMA-style registry entry whose shape the overrides replace


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU allowed (tests the script, not the GPU)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the memory snapshots (2 × the state)")
    p.add_argument("--work", default="", help="directory for data and runs (default: a temporary one)")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.seq_len, a.micro_batch, a.global_batch = 4, 1, 32, 2, 4
    if a.global_batch % a.micro_batch:
        p.error("--global-batch must be a multiple of --micro-batch")
    return a


def shape(a: argparse.Namespace) -> dict[str, int]:
    return SMOKE if a.smoke else FULL


def peak_flops(device: str) -> tuple[float, str]:
    """bf16 dense peak of this device (0 on the CPU: no MFU)."""
    import torch

    from stalwart.plan.hardware import get_gpu

    if device == "cpu":
        return 0.0, "cpu"
    name = torch.cuda.get_device_name()
    for key in ("h200", "h100", "a100"):
        if key in name.lower():
            return get_gpu(key).tflops * 1e12, name
    return 0.0, name


def train_cmd(a: argparse.Namespace, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    s = shape(a)
    return [
        sys.executable,
        "-m",
        "stalwart",
        "train",
        "--config",
        "configs/debug.toml",
        f"--model.name={BASE_MODEL}",
        *(f"--model.{k}={v}" for k, v in s.items()),
        f"--data.dir={data}",
        f"--data.seq_len={a.seq_len}",
        f"--train.steps={steps}",
        f"--train.global_batch={a.global_batch}",
        f"--train.micro_batch={a.micro_batch}",
        "--train.warmup_steps=0",
        "--train.deterministic=false",  # the plain loop does not pay for determinism either
        f"--train.log_every={10**6}",
        f"--train.out_dir={out}",
        "--json",
        *extra,
    ]


def run(cmd: list[str], env: dict[str, str] | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800)
    if ok and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def metrics(out: Path, skip: int) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[skip:]


def plain_loop(a: argparse.Namespace, data: Path, device: str) -> dict[str, float]:
    """The baseline: the same model and batch in a bare loop (no DDP, no hooks, no checkpoints)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from stalwart.models import build_model, model_args

    torch.manual_seed(0)
    index = json.loads((data / "index.json").read_text())
    tokens = np.concatenate([np.memmap(data / s["file"], dtype=index["dtype"], mode="r") for s in index["shards"]])
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    args = model_args(BASE_MODEL, vocab_size=vocab, max_seq_len=a.seq_len, **shape(a))
    model = build_model(BASE_MODEL, args).to(device)
    model.init_weights(0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device != "cpu")
    n_micro = a.global_batch // a.micro_batch
    n_seq = (len(tokens) - 1) // a.seq_len
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        start = (step * a.global_batch) % (n_seq - a.global_batch)
        rows = np.stack(
            [tokens[(start + i) * a.seq_len : (start + i + 1) * a.seq_len + 1] for i in range(a.global_batch)]
        )
        batch = torch.from_numpy(rows.astype(np.int64)).to(device, non_blocking=True)
        for i in range(n_micro):
            mb = batch[i * a.micro_batch : (i + 1) * a.micro_batch]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device != "cpu"):
                logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten()) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in params)
    del model, opt
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[a.warmup :]), "n_params": n_params}


def measure(a: argparse.Namespace) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.smoke:
        raise SystemExit(
            "benchmarks/gpu_step.py needs CUDA (torch.cuda.is_available() is False); --smoke runs a tiny CPU shape"
        )
    from stalwart.checkpoint.snapshot import shm_free_bytes
    from stalwart.data import ensure_default_corpus
    from stalwart.plan.compute import flops_per_token

    work = Path(a.work or tempfile.mkdtemp(prefix="stalwart-gpu-step-"))
    data = ensure_default_corpus(work / "data")
    peak, device_name = peak_flops(device)
    tokens_per_step = a.global_batch * a.seq_len
    steps = a.warmup + a.steps

    base = plain_loop(a, data, device)
    fpt = flops_per_token(base["n_params"], shape(a)["n_layers"], shape(a)["dim"], a.seq_len)

    def rates(step_s: float) -> dict[str, float | None]:
        tps = tokens_per_step / step_s
        return {"step_s": step_s, "tokens_per_s": tps, "mfu": fpt * tps / peak if peak else None}

    out = work / "stalwart"
    run(train_cmd(a, data, out, steps))
    ours = statistics.median(r["step_time_s"] for r in metrics(out, a.warmup))

    result: dict = {
        "device": device_name,
        "torch": torch.__version__,
        "model": {"base": BASE_MODEL, **shape(a), "n_params": base["n_params"], "flops_per_token": fpt},
        "seq_len": a.seq_len,
        "global_batch": a.global_batch,
        "micro_batch": a.micro_batch,
        "steps": a.steps,
        "peak_flops": peak,
        "baseline": {"name": "plain PyTorch loop", **rates(base["step_s"])},
        "stalwart": rates(ours),
        "torchtitan": "importable, not wired as a baseline yet"
        if importlib.util.find_spec("torchtitan")
        else "not importable",
    }
    b, s = result["baseline"], result["stalwart"]
    result["throughput_ratio"] = s["tokens_per_s"] / b["tokens_per_s"]
    result["checkpoint"] = checkpoint_costs(a, data, work, steps, shm_free_bytes)
    return result


def checkpoint_costs(a: argparse.Namespace, data: Path, work: Path, steps: int, shm_free) -> dict:
    """A run with a memory snapshot every step gives the blocking; a short run SIGKILLed (chaos)
    after its step 2 and restarted gives the restore from shared memory."""

    def flags(out: Path) -> list[str]:
        return [
            "--checkpoint.enabled=true",
            f"--checkpoint.dir={out / 'checkpoints'}",
            f"--checkpoint.shm_dir={a.shm_dir}",
            "--checkpoint.memory_every=1",
            "--checkpoint.persist_every_steps=0",  # memory only: persisting is the keeper's, off the step's path
        ]

    out = work / "ckpt"
    every = run(train_cmd(a, data, out, steps, *flags(out)), ok=False)
    if every.returncode != 0 and "memory snapshots need" in every.stderr:  # too little tmpfs: say why
        return {"skipped": every.stderr.strip().splitlines()[-1], "shm_free_bytes": shm_free(Path(a.shm_dir))}
    if every.returncode != 0:
        raise SystemExit(f"the checkpointed run failed:\n{every.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = metrics(out, a.warmup)
    step_s = statistics.median(r["step_time_s"] for r in rows)
    save_s = statistics.median(r["checkpoint_s"] for r in rows)
    hook_s = summary["checkpoint"]["hook_wait_s"] / summary["steps"]  # the optimizer hook's waits, per step
    killed_out = work / "restore"
    chaos = {"STALWART_CHAOS": "kill:step=2", "STALWART_CHAOS_DIR": str(work / "chaos")}
    killed = run(train_cmd(a, data, killed_out, 4, *flags(killed_out)), env=chaos, ok=False)
    if killed.returncode == 0:
        raise SystemExit("the restore run was not killed by chaos; cannot measure the restore")
    run(train_cmd(a, data, killed_out, 4, *flags(killed_out)))
    ck = json.loads((killed_out / "summary.json").read_text())["checkpoint"]
    return {
        "step_s": step_s,
        "save_call_s": save_s,
        "hook_wait_s_per_step": hook_s,
        "blocking_fraction": (save_s + hook_s) / step_s,
        "snapshots": summary["checkpoint"]["snapshots"],
        "restored_from": ck["restored_from"],
        "restore_step": ck["restore_step"],
        "restore_s": ck["restore_s"],
    }


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    r = measure(a)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    b, s, c = r["baseline"], r["stalwart"], r["checkpoint"]
    mfu = lambda x: f"{x['mfu']:.1%}" if x["mfu"] is not None else "n/a"  # noqa: E731
    print(f"{r['device']}, {r['model']['n_params'] / 1e9:.2f} B params, seq {r['seq_len']}, batch {r['global_batch']}")
    print(f"plain loop  {b['tokens_per_s']:,.0f} tok/s  MFU {mfu(b)}")
    print(f"stalwart    {s['tokens_per_s']:,.0f} tok/s  MFU {mfu(s)}  ({r['throughput_ratio']:.3f} × baseline)")
    if "skipped" in c:
        print(f"checkpoints: skipped ({c['skipped']})")
    else:
        print(f"snapshot every step: {c['blocking_fraction']:.2%} of a step blocking")
        print(f"restore from {c['restored_from']}: {c['restore_s']:.2f} s")


if __name__ == "__main__":
    main()
