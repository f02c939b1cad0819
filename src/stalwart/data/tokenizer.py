"""Tokenizers: a dependency-free byte tokenizer and byte-level BPE trained with HF ``tokenizers``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

TOKENIZERS = ("byte", "bpe")
EOS_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, out_dir: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus one end-of-document token (256)."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, out_dir: Path) -> None:  # nothing to save: the tokenizer is fixed
        pass


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) trained with HF tokenizers, stored as tokenizer.json."""

    name = "bpe"

    def __init__(self, hf_tokenizer: object) -> None:
        self._tok = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()
        eos = hf_tokenizer.token_to_id(EOS_TEXT)
        assert eos is not None, "BPE tokenizer lacks its end-of-document token"
        self.eos_id = eos

    @classmethod
    def train(cls, texts: Iterator[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257 + 1:
            raise ValueError(f"--vocab-size {vocab_size} is too small for byte-level BPE (need ≥ 258)")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def save(self, out_dir: Path) -> None:
        self._tok.save(str(out_dir / "tokenizer.json"))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def load_tokenizer(data_dir: Path) -> Tokenizer:
    """The tokenizer a prepared data directory was built with."""
    manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
    kind = manifest["tokenizer"]["name"]
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.load(Path(data_dir) / "tokenizer.json")
    raise ValueError(f"{data_dir}: manifest names unknown tokenizer {kind!r}")
