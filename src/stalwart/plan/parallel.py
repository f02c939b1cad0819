"""A parallel layout (DP×TP×PP×CP×EP, micro-batch, ZeRO, recompute) and the pipeline partition.

Shared by the memory estimator and the layout search so both see the same stage contents.
Rank order follows Megatron-LM (TP fastest, then CP, DP, PP), which decides which groups stay
inside a node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from stalwart.plan.shape import ModelShape

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel degree, carved out of dp (MoE only)
    micro_batch: int = 1  # sequences per forward/backward on one pipeline
    virtual_stages: int = 1  # interleaved 1F1B chunks per GPU (Narayanan et al. 2021)
    zero: int = 1  # ZeRO stage over the data-parallel group (0-3)
    recompute: str = "selective"  # none | selective | full (Korthikanti et al. 2022)

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "virtual_stages"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.dp % self.ep:
            raise ValueError(f"expert parallel degree {self.ep} must divide data parallel degree {self.dp}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def zero_group(self) -> int:
        """Ranks that shard optimizer state (Megatron's distributed optimizer uses DP×CP)."""
        return self.dp * self.cp

    def num_micro_batches(self, global_batch: int) -> int:
        per_step = self.dp * self.micro_batch
        if global_batch % per_step:
            raise ValueError(f"global batch {global_batch} is not divisible by dp {self.dp} × "
                             f"micro-batch {self.micro_batch}")
        return global_batch // per_step

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def partition_layers(n_layers: int, pp: int, head_share: float = 0.0) -> list[int]:
    """Layers per pipeline stage that minimise the slowest stage when the last stage also runs the
    LM head (worth ``head_share`` layers). Earlier stages split the rest evenly."""
    if pp < 1 or pp > n_layers:
        raise ValueError(f"pipeline stages ({pp}) must be between 1 and the layer count ({n_layers})")
    if pp == 1:
        return [n_layers]
    best: tuple[float, int] | None = None
    for last in range(1, math.ceil(n_layers / pp) + 1):
        rest = n_layers - last
        if rest < pp - 1:
            break
        worst = max(math.ceil(rest / (pp - 1)), last + head_share)
        if best is None or worst < best[0]:
            best = (worst, last)
    assert best is not None
    last = best[1]
    rest, stages = n_layers - last, pp - 1
    counts = [rest // stages + (1 if i < rest % stages else 0) for i in range(stages)]
    return counts + [last]


def moe_layers_in(shape: ModelShape, n_layers: int) -> int:
    """MoE layers among ``n_layers`` consecutive layers (proportional share, rounded up)."""
    if not shape.is_moe:
        return 0
    return min(n_layers, math.ceil(n_layers / shape.moe_every))
