"""`stalwart ckpt`: inspect, verify and export the checkpoints in a directory (local or fsspec URL)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from stalwart.commands.common import emit

EPILOG = """\
examples:
  stalwart ckpt ls runs/debug/checkpoints
  stalwart ckpt show runs/debug/checkpoints --step 120
  stalwart ckpt verify runs/debug/checkpoints            # exit 1 naming each bad shard
  stalwart ckpt export runs/debug/checkpoints --format safetensors --out model.safetensors
  stalwart ckpt persist-from-memory /dev/shm/stalwart-UID/JOB-NODE  # a job's state that storage failed
  stalwart ckpt gc --dry-run                              # ended jobs' snapshots left in /dev/shm
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ckpt",
        help="list, show, verify and export checkpoints",
        description="Work with stalwart checkpoints (DCP format, one step-NNNNNNNN directory "
        "per checkpoint, a `latest` pointer). DIR is a path or an fsspec URL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_ in (
        ("ls", "list checkpoints: step, state (committed / torn), size, world size"),
        ("show", "manifest and contents of one checkpoint"),
        ("verify", "check every file's size and CRC32 against the manifest"),
        ("export", "write the full, unsharded model weights for evaluation or HF tools"),
    ):
        a = actions.add_parser(name, help=help_, description=help_)
        a.add_argument("dir", metavar="DIR")
        a.add_argument("--json", action="store_true", help="print one JSON object")
        if name != "ls":
            a.add_argument(
                "--step",
                type=int,
                help="checkpoint step (default: latest"
                + (", or all checkpoints for verify)" if name == "verify" else ")"),
            )
        if name == "export":
            a.add_argument("--format", choices=("torch", "safetensors"), default="safetensors")
            a.add_argument("--out", required=True, help="output file")
            a.add_argument("--prefix", default="model", help="state key to export (default: model)")
        a.set_defaults(handler=run)
    a = actions.add_parser(
        "persist-from-memory",
        help="write a job's newest shared-memory snapshot (all ranks agree on it) as a committed checkpoint",
        description="Persist the newest snapshot every rank of a job holds in shared memory, e.g. after the job "
        "stopped because its checkpoint store failed (its error names SHM_DIR). Writes to the job's own "
        "storage unless --to names another. Exit 0 when the state is committed (or already was).",
    )
    a.add_argument("shm_dir", metavar="SHM_DIR", help="the job's directory, e.g. /dev/shm/stalwart-<uid>/<job>-<node>")
    a.add_argument("--to", metavar="URL", help="storage to write to (default: the job's checkpoint.dir)")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(handler=run)
    a = actions.add_parser(
        "gc",
        help="list and remove ended jobs' snapshots left in shared memory (yours only, never a live job's)",
        description="List this user's job directories under the shm root (size, age, expiry, whether a live "
        "worker or keeper owns them) and remove those whose keep time (checkpoint.keep_shm_s) has passed; "
        "--all removes every one no live process owns.",
    )
    a.add_argument(
        "--shm-dir", default=None, help="the shm root (checkpoint.shm_dir; default $STALWART_SHM_DIR or /dev/shm)"
    )
    a.add_argument("--all", action="store_true", help="also remove snapshots not yet expired (no live job's)")
    a.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    a.add_argument(
        "--keep-s",
        type=float,
        default=None,
        help="expiry of directories without a kept.json record, seconds after their last change "
        "(default: their job's keep_shm_s, else 6 h)",
    )
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(handler=run)


def _storage(url: str) -> Any:
    from stalwart.checkpoint.storage import Storage

    storage = Storage(url)
    if not storage.fs.exists(storage.root):
        raise ValueError(f"checkpoint directory {url} does not exist")
    return storage


def _pick(storage: Any, step: int | None) -> int:
    if step is not None:
        if step not in storage.steps():
            raise ValueError(f"no checkpoint for step {step} in {storage.url}; `stalwart ckpt ls` lists them")
        return step
    committed = storage.committed()
    if not committed:
        raise ValueError(f"no committed checkpoint in {storage.url}")
    return committed[0]


def run(args: argparse.Namespace, *_: Any) -> int:
    actions = {
        "ls": _ls,
        "show": _show,
        "verify": _verify,
        "export": _export,
        "persist-from-memory": _persist,
        "gc": _gc,
    }
    return actions[args.action](args)


def _persist(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stalwart.checkpoint.node_job import NodeJob

    job = NodeJob(Path(args.shm_dir))
    if not job.paths.job.is_file():
        listing = f"ls /dev/shm/stalwart-{os.geteuid()}"
        raise ValueError(f"{args.shm_dir} holds no job's snapshots (no {job.paths.job.name}); `{listing}`")
    if args.to is None and not job.job().get("storage"):
        raise ValueError(f"{job.paths.job} names no storage; pass --to URL")
    result = job.save_on_failure(args.to, None if args.to else job.job().get("storage_options"), quiet=True)
    ok = result["persisted"] or result["covered"]  # a committed checkpoint already holds the step
    if args.json:
        print(json.dumps({**result, "ok": ok}))
    else:
        print(("ok: " if ok else "FAILED: ") + result["detail"])
    return 0 if ok else 1


def _gc(args: argparse.Namespace) -> int:
    from stalwart.checkpoint import shm_gc
    from stalwart.checkpoint.shm import default_shm_root

    args.shm_dir = args.shm_dir or default_shm_root()
    entries = shm_gc.scan(args.shm_dir, shm_gc.DEFAULT_KEEP_S if args.keep_s is None else args.keep_s)
    removed = {d.path for d in shm_gc.sweep(entries, everything=args.all, dry_run=args.dry_run)}
    if args.json:
        rows = [{**d.as_dict(), "removed": d.path in removed} for d in entries]
        print(json.dumps({"shm_dir": args.shm_dir, "dry_run": args.dry_run, "dirs": rows}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for d in entries:
        state = (
            f"live ({d.live})"
            if d.live
            else verb
            if d.path in removed
            else "expired"
            if d.expired
            else "kept until " + time.strftime("%m-%d %H:%M", time.localtime(d.until))
            if d.until
            else "kept (unmarked)"
        )
        print(f"{d.path}  {d.bytes / 2**20:.1f} MiB  {d.age_s / 3600:.1f} h old  {state}")
    freed = sum(d.bytes for d in entries if d.path in removed) / 2**20
    print(f"{len(entries)} job directories; {verb} {len(removed)} ({freed:.1f} MiB)")
    return 0


def _ls(args: argparse.Namespace) -> int:
    storage = _storage(args.dir)
    storage.refresh()
    latest, committed = storage.latest(), set(storage.committed())
    rows = []
    for step in reversed(storage.steps()):
        m = storage.manifest(step) or {}
        state = "committed" if step in committed else ("torn" if not m else "uncommitted")
        rows.append(
            {
                "step": step,
                "state": state,
                "latest": step == latest,
                "bytes": m.get("bytes"),
                "world_size": m.get("world_size"),
                "source": m.get("source"),
                "created": m.get("created"),
            }
        )
    if args.json:
        print(json.dumps({"dir": storage.url, "latest": latest, "checkpoints": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoints in {storage.url}")
    for col in ("step", "state", "size", "ranks", "source", "created"):
        table.add_column(col)
    for r in rows:
        size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        created = time.strftime("%m-%d %H:%M:%S", time.localtime(r["created"])) if r["created"] else "-"
        table.add_row(
            str(r["step"]) + (" (latest)" if r["latest"] else ""),
            r["state"],
            size,
            str(r["world_size"] or "-"),
            r["source"] or "-",
            created,
        )
    Console().print(table)
    return 0


def _show(args: argparse.Namespace) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = _storage(args.dir)
    step = _pick(storage, args.step)
    manifest = storage.manifest(step)
    md = storage.read_metadata(step)
    groups: dict[str, dict[str, int]] = {}
    for key, m in md.state_dict_metadata.items():
        g = groups.setdefault(key.split(".", 1)[0], {"tensors": 0, "bytes": 0, "objects": 0})
        if isinstance(m, TensorStorageMetadata):
            g["tensors"] += 1
            g["bytes"] += m.size.numel() * m.properties.dtype.itemsize
        else:
            g["objects"] += 1
    result = {
        "dir": storage.url,
        "step": step,
        "path": storage.checkpoint_id(step),
        "committed": manifest is not None and step in storage.committed(),
        "world_size": (manifest or {}).get("world_size"),
        "source": (manifest or {}).get("source"),
        "files": len((manifest or {}).get("files", {})),
        "bytes": (manifest or {}).get("bytes"),
        "keys": len(md.state_dict_metadata),
        "groups": groups,
    }
    emit(result, args.json, f"checkpoint step {step}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    storage = _storage(args.dir)
    storage.refresh()
    steps = [args.step] if args.step is not None else list(reversed(storage.steps()))
    if not steps:
        raise ValueError(f"no checkpoints in {storage.url}")
    report, committed = {}, set(storage.committed())
    for step in steps:
        report[step] = storage.verify(step)
        if step not in committed and not report[step]:
            report[step] = [f"step {step}: beyond `latest` (a failed or in-progress attempt; never resumed from)"]
    bad = {s: p for s, p in report.items() if p}
    if args.json:
        print(
            json.dumps(
                {
                    "dir": storage.url,
                    "ok": not bad,
                    "checked": steps,
                    "torn": sorted(s for s in steps if s not in committed),
                    "problems": {str(s): p for s, p in bad.items()},
                }
            )
        )
    else:
        for step, problems in report.items():
            print(f"step {step}: " + ("ok" if not problems else "FAILED"))
            for p in problems:
                print(f"  {p}")
    return 1 if bad else 0


def _export(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from stalwart.checkpoint.restore import load_checkpoint

    storage = _storage(args.dir)
    step = _pick(storage, args.step)
    problems = storage.verify(step)
    if problems:
        raise ValueError(f"checkpoint step {step} failed verification: {'; '.join(problems)}")
    prefix = args.prefix.rstrip(".") + "."
    md = storage.read_metadata(step)
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"checkpoint step {step} has no tensors under {args.prefix!r}")
    t0 = time.perf_counter()
    load_checkpoint(storage, step, state)
    weights = {k[len(prefix) :]: v.contiguous() for k, v in state.items()}
    if args.format == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, args.out, metadata={"format": "pt", "stalwart_step": str(step), "source": storage.url})
    else:
        torch.save(weights, args.out)
    result = {
        "out": args.out,
        "format": args.format,
        "step": step,
        "tensors": len(weights),
        "params": sum(v.numel() for v in weights.values()),
        "seconds": time.perf_counter() - t0,
    }
    emit(result, args.json, "export")
    return 0
