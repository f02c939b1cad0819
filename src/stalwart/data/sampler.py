"""World-size-independent global sampler.

The sample stream is the concatenation of per-epoch permutations, each drawn from (seed, epoch)
alone. A step consumes the next ``global_batch`` positions of that stream and each rank takes a
contiguous slice of them. The only state is the number of positions consumed, so a resume at any
world size continues at exactly the same sample: no sample is dropped or repeated, and every sample of
every epoch is seen exactly once. Batches may straddle an epoch boundary; nothing is dropped.

Skip ranges (``data.skip_samples``, e.g. the range a training-health rollback skipped) name stream
positions that are never served: a batch takes the next ``global_batch`` positions outside them, so a
run configured with a rollback's recorded range sees exactly the stream of the run that rolled back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def format_skip_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping and touching ranges joined, empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted((a, b) for a, b in ranges if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def parse_skip_ranges(text: str) -> list[tuple[int, int]]:
    """``"320:352,640:704"`` → [(320, 352), (640, 704)]: half-open stream position ranges, sorted and
    merged. ValueError says what is wrong with a bad item."""
    ranges = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        start, sep, stop = item.partition(":")
        try:
            a, b = int(start), int(stop)
        except ValueError:
            a, b = -1, -1
        if not sep or a < 0 or b <= a:
            raise ValueError(
                f"data.skip_samples: bad range {item!r}; use START:STOP with 0 ≤ START < STOP "
                "(stream positions, as recorded in summary.json guard.rollbacks), comma-separated"
            )
        ranges.append((a, b))
    return merge_ranges(ranges)


class GlobalSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        skip: Sequence[tuple[int, int]] = (),
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self.skip_ranges = merge_ranges(skip)
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

    def _next_positions(self, consumed: int | None = None) -> tuple[list[tuple[int, int]], int]:
        """The global batch starting at ``consumed`` (default: the next one) as contiguous position
        runs outside the skip ranges, and the position after it."""
        pos = self.consumed if consumed is None else consumed
        need, runs = self.global_batch, []
        for a, b in self.skip_ranges:
            if b <= pos:
                continue
            if a > pos:
                take = min(need, a - pos)
                runs.append((pos, pos + take))
                pos, need = pos + take, need - take
                if not need:
                    break
            pos = max(pos, b)
        if need:
            runs.append((pos, pos + need))
            pos += need
        return runs, pos

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
        """Sample ids for this rank in the next global batch; advances by one global batch (plus any
        skip range it jumps over)."""
        ids, self.consumed = self.batch_at(self.consumed, rank, world_size)
        return ids

    def batch_at(self, consumed: int, rank: int, world_size: int) -> tuple[np.ndarray, int]:
        """This rank's sample ids of the global batch that starts after ``consumed`` positions, and
        ``consumed`` after it; changes nothing (a prefetcher reads ahead without moving the state a
        checkpoint captures)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        start = rank * self.global_batch // world_size
        stop = (rank + 1) * self.global_batch // world_size
        if not self.skip_ranges:
            return self.samples_at(consumed + start, consumed + stop), consumed + self.global_batch
        runs, after = self._next_positions(consumed)
        batch = np.concatenate([self.samples_at(a, b) for a, b in runs])
        return batch[start:stop], after

    def skip(self, n_batches: int) -> tuple[int, int]:
        """Never serve the next n global batches (e.g. past a loss spike). Their positions join the
        skip ranges, which a later ``load_state_dict`` keeps: a rollback to an earlier state skips
        them again, and a further skip extends past them. Returns (position before, after)."""
        if n_batches < 0:
            raise ValueError(f"cannot skip a negative number of batches ({n_batches})")
        start = self.consumed
        for _ in range(n_batches):
            runs, self.consumed = self._next_positions()
            self.skip_ranges = merge_ranges([*self.skip_ranges, *runs])
        return start, self.consumed

    # -- Stateful ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "skip": format_skip_ranges(self.skip_ranges),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; the data or seed changed since the checkpoint"
                )
        self.consumed = int(state["consumed"])
        # Skip ranges only accumulate: ours (config, rollbacks of this process) and the checkpoint's.
        self.skip_ranges = merge_ranges([*self.skip_ranges, *parse_skip_ranges(str(state.get("skip", "")))])
