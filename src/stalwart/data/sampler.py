"""World-size-independent global sampler.

The sample stream is the concatenation of per-epoch permutations, each drawn from (seed, epoch)
alone. A step consumes the next ``global_batch`` positions of that stream and each rank takes a
contiguous slice of them. The only state is the number of positions consumed, so a resume at any
world size continues at exactly the same sample: no sample is dropped or repeated, and every sample of
every epoch is seen exactly once. Batches may straddle an epoch boundary; nothing is dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class GlobalSampler:
    def __init__(self, num_samples: int, global_batch: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    # -- order ---------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def samples_at(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at global stream positions [start, stop)."""
        out = []
        while start < stop:
            epoch, offset = divmod(start, self.num_samples)
            take = min(stop - start, self.num_samples - offset)
            out.append(self.epoch_order(epoch)[offset : offset + take])
            start += take
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    # -- stepping ------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    @property
    def steps_done(self) -> int:
        return self.consumed // self.global_batch

    def rank_slice(self, rank: int, world_size: int) -> tuple[int, int]:
        """This rank's positions of the next global batch (contiguous, sizes differ by ≤ 1)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        start = self.consumed + rank * self.global_batch // world_size
        stop = self.consumed + (rank + 1) * self.global_batch // world_size
        return start, stop

    def next_batch(self, rank: int, world_size: int) -> np.ndarray:
        """Sample ids for this rank in the next global batch; advances by one global batch."""
        ids = self.samples_at(*self.rank_slice(rank, world_size))
        self.consumed += self.global_batch
        return ids

    def skip(self, n_batches: int) -> tuple[int, int]:
        """Skip n global batches (e.g. past a loss spike); returns the skipped position range."""
        if n_batches < 0:
            raise ValueError(f"cannot skip a negative number of batches ({n_batches})")
        start = self.consumed
        self.consumed += n_batches * self.global_batch
        return start, self.consumed

    # -- Stateful ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; the data or seed changed since the checkpoint"
                )
        self.consumed = int(state["consumed"])
