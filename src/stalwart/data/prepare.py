"""Turn text / JSONL files into memory-mapped token shards.

Output directory:
  shard_00000.bin ...   raw token ids (uint16, or uint32 when the vocabulary needs it),
                        documents concatenated, each followed by the end-of-document token
  index.json            shard list: file, token count, sha256 — what the reader memory-maps
  manifest.json         tokenizer, counts, sources with checksums, creation parameters
  tokenizer.json        (BPE only) the trained HF tokenizer

The directory is written under a temporary name and renamed into place, so a crash or a concurrent
preparer never leaves a half-written dataset behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.data.tokenizer import TOKENIZERS, BPETokenizer, ByteTokenizer, Tokenizer, token_dtype

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
DEFAULT_CORPUS = "stdlib"
DEFAULT_CORPUS_BYTES = 4 << 20
DEFAULT_SHARD_TOKENS = 1 << 24


@dataclass(frozen=True)
class Document:
    source: Path
    text: str


def stdlib_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The default corpus: top-level modules of this Python's standard library, in name order.

    Ships with every Python installation, so the demo needs no download.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(lib.glob("*.py")):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    if not files:
        raise ValueError(f"no Python source files found in the standard library at {lib}")
    return files


def collect_files(inputs: list[str]) -> list[Path]:
    """Expand files and directories (recursively) into a sorted list of input files."""
    if not inputs:
        raise ValueError("no --input given")
    files: list[Path] = []
    for item in inputs:
        if item == DEFAULT_CORPUS:
            files.extend(stdlib_files())
            continue
        path = Path(item)
        if not path.exists():
            raise ValueError(f"input {item!r} does not exist")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not found:
                raise ValueError(f"input directory {item!r} has no text files (looked for {', '.join(TEXT_SUFFIXES)})")
            files.extend(found)
        else:
            files.append(path)
    return files


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise ValueError(f"{path} looks binary (contains NUL bytes); give text or JSONL files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}): give text or JSONL files") from None


def read_documents(files: list[Path], text_key: str = "text") -> Iterator[Document]:
    """One document per text file, or one per line of a .jsonl file (field `text_key`)."""
    for path in files:
        text = _read_text(path)
        if path.suffix != ".jsonl":
            if text:
                yield Document(path, text)
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string field {text_key!r}")
            yield Document(path, record[text_key])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _ShardWriter:
    """Appends token arrays to fixed-size shards and records each shard's count and checksum."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._count = 0

    def _open(self) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        self._file = open(self.out / name, "wb")
        self.shards.append({"file": name, "n_tokens": 0})
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._file is None or self._count == self.shard_tokens:
                self._close()
                self._open()
            take = min(tokens.size, self.shard_tokens - self._count)
            self._file.write(tokens[:take].astype(self.dtype).tobytes())
            self._count += take
            self.shards[-1]["n_tokens"] = self._count
            tokens = tokens[take:]

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def finish(self) -> list[dict]:
        self._close()
        for shard in self.shards:
            shard["sha256"] = _sha256(self.out / shard["file"])
        return self.shards


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    text_key: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Prepare a token dataset; returns the manifest. Raises ValueError on bad input."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(out)
    if (out / "manifest.json").exists() and not overwrite:
        raise ValueError(f"{out} already holds a prepared dataset; pass --overwrite to replace it")
    files = collect_files(inputs)
    docs = list(read_documents(files, text_key))
    if not any(d.text for d in docs):
        raise ValueError(f"the inputs hold no text ({len(files)} file(s) read)")

    tok: Tokenizer
    if tokenizer == "byte":
        tok = ByteTokenizer()
    else:
        tok = BPETokenizer.train((d.text for d in docs), vocab_size)
    dtype = token_dtype(tok.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writer = _ShardWriter(tmp, dtype, shard_tokens)
        n_tokens = 0
        for i, doc in enumerate(docs):
            ids = np.asarray([*tok.encode(doc.text), tok.eos_id], dtype=np.int64)
            writer.write(ids)
            n_tokens += ids.size
            if progress:
                progress(i + 1, len(docs))
        shards = writer.finish()
        tok.save(tmp)
        index = {"dtype": dtype.name, "shards": shards}
        manifest = {
            "format": "stalwart-tokens/1",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            "dtype": dtype.name,
            "n_tokens": n_tokens,
            "n_documents": len(docs),
            "n_shards": len(shards),
            "sources": [{"path": str(p), "sha256": _sha256(p)} for p in files],
            "python": sys.version.split()[0],
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if (out / "manifest.json").exists() and not overwrite:
            # A concurrent preparer (another node on a shared file system) finished first.
            shutil.rmtree(tmp)
            return json.loads((out / "manifest.json").read_text())
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def ensure_default_corpus(out: str | Path) -> Path:
    """Prepare the stdlib corpus with the byte tokenizer unless `out` already holds a dataset."""
    out = Path(out)
    if not (out / "manifest.json").exists():
        prepare([DEFAULT_CORPUS], out, tokenizer="byte")
    return out


def verify(data_dir: str | Path) -> list[str]:
    """Names of shards whose size or sha256 differs from index.json (empty list = intact)."""
    data_dir = Path(data_dir)
    index = json.loads((data_dir / "index.json").read_text())
    itemsize = np.dtype(index["dtype"]).itemsize
    bad = []
    for shard in index["shards"]:
        path = data_dir / shard["file"]
        if not path.exists() or path.stat().st_size != shard["n_tokens"] * itemsize or _sha256(path) != shard["sha256"]:
            bad.append(shard["file"])
    return bad
