"""`stalwart demo`, end to end: the faulted job, its fault-free reference (cached), the report."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from stalwart.demo.job import NODES, DemoOptions, run_job
from stalwart.demo.report import report


def _reference_key(opts: DemoOptions, data_dir: Path) -> str:
    import torch

    import stalwart

    manifest = (data_dir / "manifest.json").read_bytes() if (data_dir / "manifest.json").exists() else b""
    # The code that decides the weights (initialisation, step, data order): a change there invalidates
    # the cached reference even when the version number stays.
    package = Path(stalwart.__file__).parent
    code = hashlib.sha256()
    for source in sorted(p for d in ("models", "train", "data") for p in (package / d).rglob("*.py")):
        code.update(source.read_bytes())
    blob = json.dumps(
        {
            "overrides": opts.train_overrides(),
            "nodes": NODES,
            "torch": torch.__version__,
            "stalwart": stalwart.__version__,
            "code": code.hexdigest(),
            "data": hashlib.sha256(manifest).hexdigest(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_hash(opts: DemoOptions, data_dir: Path, console: Console) -> tuple[str, bool]:
    """(hash, cached): the final weights of a fault-free run of the same job, cached by config."""
    cache, key = opts.out_dir / "reference.json", _reference_key(opts, data_dir)
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    if key in cached:
        return cached[key], True
    console.print(f"reference: fault-free run of the same job ({opts.steps} steps), cached in {cache}")
    job = run_job(opts, opts.out_dir / "reference", None, console)
    if not job.ok:
        raise RuntimeError(
            f"the reference run failed (exit codes {job.exit_codes}); logs: {', '.join(map(str, job.logs))}"
        )
    cached[key] = job.summary["final_hash"]  # type: ignore[index]
    cache.write_text(json.dumps(cached, indent=1))
    return cached[key], False


def run_demo(opts: DemoOptions, console: Console) -> tuple[dict[str, Any], bool]:
    """Run the faulted job (and the reference unless cached); (report, job succeeded)."""
    from stalwart.config import load_config
    from stalwart.data import ensure_default_corpus
    from stalwart.train.resolve import resolve

    if opts.steps < 4 * (len(opts.faults) + 1):
        raise ValueError(f"--steps must be ≥ {4 * (len(opts.faults) + 1)} to space {len(opts.faults)} faults apart")
    if opts.hang_timeout_s <= 0:
        raise ValueError("--hang-timeout must be > 0 seconds")
    cfg = load_config(None, opts.train_overrides())
    resolve(cfg, NODES)  # every mistake fails here, before the master and agents start
    data_dir = ensure_default_corpus(cfg.data.dir)  # once here, not racing in both workers
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    ref, cached = reference_hash(opts, data_dir, console) if opts.reference else (None, False)
    injected = opts.fault_steps()
    spec = ";".join(f"{action}:rank={opts.fault_rank}:step={step}" for action, step in injected)
    console.print(
        f"demo: {NODES} nodes × 1 worker, debug model, {opts.steps} steps; injecting "
        + (", ".join(f"{a} at step {s}" for a, s in injected) or "no faults")
        + f" on rank {opts.fault_rank}"
    )
    job = run_job(opts, opts.out_dir / "job", spec or None, console)
    result = report(job, injected, ref, cached, opts.fault_rank)
    result["logs"] = [str(p) for p in job.logs]
    if not job.ok:
        console.print(
            f"[bold red]the demo job failed[/] (exit codes {job.exit_codes}); logs: {', '.join(map(str, job.logs))}"
        )
    return result, job.ok
