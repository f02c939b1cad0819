"""`stalwart data prepare|info`: build and inspect token shard directories."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from stalwart.commands.common import emit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare and inspect token datasets",
        description="Turn text/JSONL into memory-mapped token shards, or inspect them.",
    )
    dsub = p.add_subparsers(dest="data_cmd", required=True, metavar="{prepare,info}")
    prep = dsub.add_parser(
        "prepare",
        help="tokenize text/JSONL files into shards",
        description="Tokenize text files (.txt .md .rst .py) and JSONL files (one document per line, "
        "field --text-key) into uint16/uint32 shards with index.json and manifest.json. "
        "Directories are searched recursively. --input stdlib (the default) uses this "
        "Python's standard library sources: a corpus that needs no download.",
    )
    prep.add_argument(
        "--input",
        nargs="+",
        default=["stdlib"],
        metavar="PATH",
        help="files or directories, or 'stdlib' (default: stdlib)",
    )
    prep.add_argument("--out", required=True, type=Path, help="output directory")
    prep.add_argument("--tokenizer", default="byte", help="byte (257 ids) or bpe (trained here; default byte)")
    prep.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    prep.add_argument("--text-key", default="text", help="JSONL field holding the text (default text)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard (default 16M)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    prep.add_argument("--json", action="store_true", help="print the manifest as one JSON object")
    prep.set_defaults(handler=_prepare)
    info = dsub.add_parser("info", help="show a dataset's manifest and verify its shard checksums")
    info.add_argument("dir", type=Path)
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=_info)


def _prepare(args: argparse.Namespace, *_: Any) -> int:
    from rich.progress import Progress

    from stalwart.data.prepare import prepare

    with Progress(transient=True, disable=args.json) as bar:
        task = bar.add_task("tokenizing", total=None)
        manifest = prepare(
            args.input,
            args.out,
            args.tokenizer,
            args.vocab_size,
            args.text_key,
            args.shard_tokens,
            args.overwrite,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    summary = {k: manifest[k] for k in ("n_tokens", "n_documents", "n_shards", "dtype")}
    summary.update(
        tokenizer=manifest["tokenizer"]["name"],
        vocab_size=manifest["tokenizer"]["vocab_size"],
        out=str(args.out),
        sources=len(manifest["sources"]),
    )
    emit(manifest if args.json else summary, args.json, f"prepared {args.out}")
    return 0


def _info(args: argparse.Namespace, *_: Any) -> int:
    from stalwart.data.prepare import verify

    manifest = json.loads((args.dir / "manifest.json").read_text()) if (args.dir / "manifest.json").exists() else None
    if manifest is None:
        raise ValueError(f"{args.dir} is not a prepared dataset (no manifest.json)")
    bad = verify(args.dir)
    result = {
        "dir": str(args.dir),
        "tokenizer": manifest["tokenizer"]["name"],
        "vocab_size": manifest["tokenizer"]["vocab_size"],
        "n_tokens": manifest["n_tokens"],
        "n_documents": manifest["n_documents"],
        "n_shards": manifest["n_shards"],
        "checksums_ok": not bad,
        "bad_shards": bad,
    }
    emit(result, args.json, f"dataset {args.dir}")
    return 0 if not bad else 1
