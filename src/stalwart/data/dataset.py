"""Read-only view of a prepared token directory as fixed-length training samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


class TokenDataset:
    """Sample i is tokens[i·seq_len : i·seq_len + seq_len + 1] of the concatenated shards
    (inputs are the first seq_len tokens, targets the last seq_len). Shards are memory-mapped,
    so opening a dataset costs nothing and every rank reads only what it samples.
    """

    def __init__(self, data_dir: str | Path, seq_len: int) -> None:
        self.dir = Path(data_dir)
        if not (self.dir / "manifest.json").exists():
            raise ValueError(
                f"{self.dir} is not a prepared dataset (no manifest.json); "
                f"run `stalwart data prepare --out {self.dir}` first"
            )
        if seq_len <= 0:
            raise ValueError(f"data.seq_len must be positive, got {seq_len}")
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        index = json.loads((self.dir / "index.json").read_text())
        dtype = np.dtype(index["dtype"])
        self.shards = [
            np.memmap(self.dir / s["file"], dtype=dtype, mode="r", shape=(s["n_tokens"],)) for s in index["shards"]
        ]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.n_tokens = int(self.offsets[-1])
        self.seq_len = seq_len
        self.num_samples = (self.n_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{self.dir} holds {self.n_tokens} tokens: too few for seq_len={seq_len}")

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def __len__(self) -> int:
        return self.num_samples

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            shard = self.shards[first]
            lo = start - self.offsets[first]
            hi = min(stop - self.offsets[first], len(shard))
            pieces.append(shard[lo:hi])
            start += hi - lo
            first += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        start = i * self.seq_len
        return self._tokens(start, start + self.seq_len + 1)

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """The samples' tokens, (len(indices), seq_len + 1) int64: inputs and targets in one tensor."""
        return torch.from_numpy(np.stack([self[int(i)] for i in indices]).astype(np.int64))

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), seq_len) int64."""
        rows = self.rows(indices)
        return rows[:, :-1], rows[:, 1:]
