"""Adaptive gradient quantization (ALQ, Faghri et al. 2020) as a DDP communication hook.

Each gradient bucket is cut into chunks of ``CHUNK`` values; a chunk is sent as its L2 norm (fp32)
plus, per value, a sign bit and the index of one of ``2**(bits-1)`` levels ``0 = l_0 < … < l_K = 1``
for ``|g| / norm``, chosen by stochastic rounding between the two enclosing levels (unbiased:
``E[q] = g``). The levels are not fixed (QSGD: uniform; NUQSGD: exponential) but fitted to the
gradients' own distribution of normalised magnitudes — the ALQ coordinate descent on the expected
rounding variance — and refitted every ``update_every`` steps.

Wire format, per bucket and rank (one ``all_gather`` of uint8, since summing level indices means
nothing): ``[codes: ceil(n_pad·bits/8) B][norms: 4·n_chunks B][levels: 4·(K+1) B on update steps]``,
``n_pad`` = the bucket's length rounded up to whole chunks. Every rank decodes every rank's bytes
in rank order with the same levels, so the averaged gradient is bitwise equal on all ranks. On a
refit each rank appends the levels it fitted to its own gradient; all ranks adopt their mean for the
next step. Note what all-gather costs: a ring all-gather sends ``(W-1)·payload`` per rank against
``2(W-1)/W·4n`` for an fp32 ring all-reduce, so the saving ``W·bits/64`` of the fp32 volume shrinks
as the world grows (4 bits: 8× fewer bytes at W = 2, break-even at W = 16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

CHUNK = 2048  # values per norm (ALQ's "bucket size"); 4 B of norm per 2048 values
BITS = (2, 4, 8)  # codes per byte must be whole
SAMPLE = 1 << 15  # values the level fit looks at per bucket (a strided subsample)


def initial_levels(bits: int) -> torch.Tensor:
    """Exponential levels ``0, 2^-e, …, 1/2, 1`` (NUQSGD's halvings, e ≤ 10 so that 8 bits do not
    spend levels below any float32 gradient): a good start for L2-normalised chunks, whose
    magnitudes crowd near zero."""
    k = 2 ** (bits - 1) - 1
    exponents = torch.linspace(-min(k - 1, 10), 0, k, dtype=torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.pow(2.0, exponents)]).float()


def quantile_levels(r: torch.Tensor, count: int) -> torch.Tensor:
    """Levels at evenly spaced quantiles of ``r`` (endpoints 0 and 1): a start that spends no level
    on an empty interval."""
    inner = torch.quantile(r.double(), torch.linspace(0, 1, count, dtype=torch.float64)[1:-1])
    return torch.cat([torch.zeros(1), inner.float(), torch.ones(1)])


def rounding_variance(r: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Mean variance ``(l_{j+1} - r)(r - l_j)`` of stochastic rounding of magnitudes ``r`` in [0, 1]."""
    hi = torch.searchsorted(levels, r, right=True).clamp(1, len(levels) - 1)
    lo_v, hi_v = levels[hi - 1], levels[hi]
    return ((hi_v - r) * (r - lo_v)).mean()


def fit_levels(r: torch.Tensor, levels: torch.Tensor, sweeps: int = 8, iters: int = 24) -> torch.Tensor:
    """ALQ's coordinate descent: each interior level moves to the root of
    ``Σ_{r∈[l_{j-1}, l)} (r - l_{j-1}) = Σ_{r∈[l, l_{j+1}]} (l_{j+1} - r)`` (the derivative of the
    rounding variance in l_j; increasing in l, so bisection finds it). Odd and even levels alternate:
    each half-sweep minimises exactly over independent coordinates, so the variance never grows from
    the start, the best of ``levels``, uniform and quantile levels (a descent from exponential levels
    alone can get stuck where a level's intervals hold no sample). Two evenly spread pseudo-samples
    per level act as a prior: without them 8 bits' 128 levels fit the few tail values of the sample
    and leave wide gaps where the next step's tail falls (in-sample variance down, out-of-sample up)."""
    r = torch.cat([r.float(), torch.linspace(0, 1, 2 * len(levels))])
    starts = [levels, torch.linspace(0, 1, len(levels)), quantile_levels(r, len(levels))]
    lv = min(starts, key=lambda c: float(rounding_variance(r, c))).double().clone()
    x = r.double().sort().values
    s = torch.cat([torch.zeros(1, dtype=torch.float64), x.cumsum(0)])

    def count_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, k = torch.searchsorted(x, a), torch.searchsorted(x, b)
        return (k - i).double(), s[k] - s[i]

    for _ in range(sweeps):
        for parity in (1, 2):
            j = torch.arange(parity, max(parity, len(lv) - 1), 2)
            if not len(j):  # 2 bits: levels 0 and 1 only, nothing to fit
                continue
            left, right = lv[j - 1], lv[j + 1]
            a, b = left.clone(), right.clone()
            for _ in range(iters):
                mid = (a + b) / 2
                n1, s1 = count_sum(left, mid)
                n2, s2 = count_sum(mid, right)
                grow = (s1 - left * n1) - (right * n2 - s2) < 0  # derivative < 0: the root is above mid
                a, b = torch.where(grow, mid, a), torch.where(grow, b, mid)
            lv[j] = (a + b) / 2
    return lv.float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits, ``8/bits`` per byte, the first in the low bits."""
    c = codes.view(-1, 8 // bits)
    out = c[:, 0].clone()
    for k in range(1, c.shape[1]):
        out |= c[:, k] << (k * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).reshape(-1)


def wire_bytes(numel: int, bits: int, refit: bool) -> int:
    """Bytes one rank contributes to the all-gather for a bucket of ``numel`` values."""
    chunks = math.ceil(numel / CHUNK)
    return chunks * CHUNK * bits // 8 + 4 * chunks + (4 * 2 ** (bits - 1) if refit else 0)


def normalized(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunks, chunk norms, magnitudes / norm in [0, 1]) of a flat gradient padded to whole chunks."""
    chunks = math.ceil(flat.numel() / CHUNK)
    x = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=flat.device)
    x[: flat.numel()] = flat
    x = x.view(chunks, CHUNK)
    norms = torch.linalg.vector_norm(x, dim=1)
    r = (x.abs() / norms.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)).clamp_(0, 1)
    return x, norms, r


def quantize(x: torch.Tensor, r: torch.Tensor, levels: torch.Tensor, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Packed codes of chunks ``x`` with normalised magnitudes ``r`` (from :func:`normalized`):
    sign bit over the level index, rounded up with probability ``(r - l_j) / (l_{j+1} - l_j)``."""
    lv = levels.to(x.device)
    hi = torch.searchsorted(lv, r, right=True, out_int32=True).clamp_(1, len(lv) - 1)
    lo_v, hi_v = lv[hi - 1], lv[hi]
    p_up = (r - lo_v).div_((hi_v - lo_v).clamp_min_(torch.finfo(torch.float32).tiny))
    u = torch.rand(r.shape, generator=gen, device=x.device)
    idx = hi.sub_((u >= p_up).int()).to(torch.uint8)
    codes = idx.bitwise_or_((x < 0).to(torch.uint8) << (bits - 1)).reshape(-1)
    return pack(codes, bits)


def dequantize(packed: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Chunks of ``sign · level · norm``: one lookup in a table of signed levels (the code is its index)."""
    lv = levels.to(packed.device)
    table = torch.cat([lv, -lv]) if bits > 1 else lv
    return table[unpack(packed, bits).int()].view(len(norms), CHUNK) * norms.unsqueeze(1)


@dataclass
class ALQState:
    """Hook state: levels per DDP bucket, the step count, and the bytes sent (for tests and benchmarks)."""

    group: dist.ProcessGroup
    bits: int = 4
    update_every: int = 50
    seed: int = 0
    step: int = 0
    levels: dict[int, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0  # all-gather input bytes of this rank, all steps
    step_bytes: list[int] = field(default_factory=list)  # per step
    bytes_before_step: int = 0
    numels: dict[int, int] = field(default_factory=dict)  # values per bucket, as last seen

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"alq_bits must be one of {BITS} (whole codes per byte), got {self.bits}")
        if self.update_every < 1:
            raise ValueError(f"alq_update_every must be ≥ 1 (steps between level refits), got {self.update_every}")

    def refit_now(self) -> bool:
        """Steps 0 and 1 (DDP rebuilds its buckets after the first), then every ``update_every``."""
        return self.step < 2 or self.step % self.update_every == 0


def alq_hook(state, bucket):  # no annotations: DDP rejects string ones (state: ALQState)
    """Quantize the bucket, all-gather every rank's bytes, decode and average them into the bucket."""
    pg, bits = state.group, state.bits
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    buffer = bucket.buffer()
    index = bucket.index()
    levels = state.levels.setdefault(index, initial_levels(bits))
    state.numels[index] = buffer.numel()
    gen = torch.Generator(device=buffer.device)
    gen.manual_seed(hash((state.seed, state.step, index, rank)) & (2**63 - 1))
    flat = buffer.detach().float()
    x, norms, r = normalized(flat)
    packed = quantize(x, r, levels, bits, gen)
    parts = [packed, norms.view(torch.uint8)]
    refit = state.refit_now()
    if refit:  # fit to this rank's magnitudes (a strided subsample, padding left out)
        sample = r.view(-1)[: flat.numel()][:: max(1, flat.numel() // SAMPLE)]
        parts.append(fit_levels(sample.cpu(), levels).to(buffer.device).view(torch.uint8))
    payload = torch.cat(parts)
    state.bytes_sent += payload.numel()
    if bucket.is_last():
        state.step_bytes.append(state.bytes_sent - state.bytes_before_step)
        state.bytes_before_step = state.bytes_sent
        state.step += 1
    gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buffer.device)
    fut = dist.all_gather_into_tensor(gathered, payload, group=pg, async_op=True).get_future()
    n_codes, n_norms = packed.numel(), norms.numel() * 4

    def decode(_: torch.futures.Future) -> torch.Tensor:
        rows = gathered.view(world, -1)
        total = torch.zeros(len(norms), CHUNK, dtype=torch.float32, device=buffer.device)
        for w in range(world):  # rank order: the same sum, bit for bit, on every rank
            row = rows[w]
            total += dequantize(row[:n_codes], row[n_codes : n_codes + n_norms].view(torch.float32), levels, bits)
        if refit:
            fitted = rows[:, n_codes + n_norms :].contiguous().view(torch.float32).view(world, -1)
            state.levels[index] = fitted.mean(0).cpu()
        out = bucket.buffer()
        out.copy_(total.view(-1)[: out.numel()].div_(world).to(out.dtype))
        return out

    return fut.then(decode)
