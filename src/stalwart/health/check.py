"""Node health check: matmul burn-in against a reference, then paired collectives in two rounds.

Runs inside every worker of a job (one world over all nodes). A "node" is a block of
`ranks_per_node` consecutive ranks, as TorchElastic assigns them.

1. Burn-in: each rank multiplies seeded matrices `iters` times; the result must match a float64
   reference computed from the same seed (catches wrong numbers and NaN, not only crashes); timed. A
   node `slow_factor` × slower than the median node burns in again and is a straggler if slow twice.
2. Round 1 pairs neighbouring nodes (0-1, 2-3, ...) for an all-reduce of a known payload; a pair fails
   if the sum is wrong, and its nodes are suspects if it is `collective_slow_factor` × slower than the
   lower median correct pair.
3. Round 2 pairs every suspect with a healthy node (slowest suspect with fastest healthy; in turns when
   suspects outnumber healthy nodes), so a single bad node is isolated even when its round-1 partner
   looked bad too; a suspect is slow if its round-2 pair is still `collective_slow_factor` × slower
   than the typical (median) pair, and again each time it is retimed beside a healthy pair.
Results travel as tensors (no pickled objects) and every rank derives the same verdict.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FAULTS = ("node-fail", "slow", "nan", "burst")  # burst: collectives slow in rounds 1-2 only (load)
RETIMES = 3  # a collective straggler is timed again (× the usual ops) beside healthy pairs before it is named


@dataclass(frozen=True)
class Fault:
    """A fault injected into one node for tests and demos: `kind:node=N[:factor=F]`."""

    kind: str
    node: int
    factor: float = 3.0

    @classmethod
    def parse(cls, spec: str | None) -> Fault | None:
        if not spec:
            return None
        kind, *pairs = spec.split(":")
        if kind not in FAULTS:
            raise ValueError(f"unknown check fault {kind!r}; use one of {', '.join(FAULTS)} (e.g. slow:node=1)")
        try:
            options = dict(p.split("=", 1) for p in pairs)
            return cls(kind, int(options["node"]), float(options.get("factor", 3.0)))
        except (KeyError, ValueError):
            raise ValueError(f"bad fault spec {spec!r}; expected KIND:node=N[:factor=F]") from None


@dataclass
class CheckConfig:
    matmul_size: int = 512
    iters: int = 24  # the fastest counts: spread over ~0.1 s so one descheduling cannot cover them all
    collective_elems: int = 1 << 18  # 1 MiB of float32
    collective_iters: int = 10
    slow_factor: float = 2.0  # burn-in: × the median node (one-shot timings on a shared host vary 1.4×)
    collective_slow_factor: float = 2.0  # pairs: × the median pair (timings of a shared link are noisier)
    seed: int = 1234
    fault: Fault | None = None
    serial: bool = False  # nodes share one host (simulated): time one node at a time, fairly


@dataclass
class NodeReport:
    node: int
    ok: bool = True
    straggler: bool = False
    matmul_ok: bool = True
    matmul_s: float = 0.0
    round1_pair: list[int] = field(default_factory=list)
    round1_s: float = 0.0
    round1_ok: bool = True
    round2_pair: list[int] | None = None
    round2_s: float | None = None
    round2_ok: bool | None = None
    reasons: list[str] = field(default_factory=list)


def _matrices(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(size, size, generator=gen, dtype=torch.float64),
        torch.randn(size, size, generator=gen, dtype=torch.float64),
    )


def reference_product(cfg: CheckConfig) -> torch.Tensor:
    """The float64 product every burn-in with `cfg`'s size and seed must reproduce (compute it once
    when burning in several devices: it costs more than the float32 runs)."""
    a64, b64 = _matrices(cfg.matmul_size, cfg.seed)
    return a64 @ b64


def burn_in(
    cfg: CheckConfig, device: torch.device, node: int, reference: torch.Tensor | None = None
) -> tuple[bool, float]:
    """(result matches the float64 reference, seconds per matmul). The time is the fastest of
    `iters` runs: robust to a process being descheduled, and a slow device is slow every time."""
    a64, b64 = _matrices(cfg.matmul_size, cfg.seed)
    if reference is None:
        reference = a64 @ b64
    a, b = a64.float().to(device), b64.float().to(device)
    fault = cfg.fault if cfg.fault and cfg.fault.node == node else None
    times = []
    for _ in range(cfg.iters):
        start = time.perf_counter()
        out = a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if fault and fault.kind == "slow":
            time.sleep(elapsed * (fault.factor - 1))
            elapsed *= fault.factor
        times.append(elapsed)
    if fault and fault.kind == "nan":
        out = out.clone()
        out[0, 0] = float("nan")
    # fp32 accumulation error grows with sqrt(k); 1e-3 relative is far above it and far below a bad bit.
    ok = bool(torch.isfinite(out).all()) and torch.allclose(out.double().cpu(), reference, rtol=1e-3, atol=1e-3)
    return ok, min(times)


def _burn_in_round(
    cfg: CheckConfig, device: torch.device, node: int, nodes: int, ranks_per_node: int
) -> list[torch.Tensor]:
    """Every node's burn-in (one node at a time when they share a host), gathered: node → rows of
    (result ok, seconds) per rank. One-shot timings on a loaded host can be 2× off for a whole burn-in
    (CI15: a healthy node named a straggler), so a node slow here is timed again before it is named."""
    if cfg.serial:
        for turn in range(nodes):
            if turn == node:
                ok, seconds = burn_in(cfg, device, node)
            dist.barrier()
    else:
        ok, seconds = burn_in(cfg, device, node)
    return _per_node(_gather([float(ok), seconds], device), ranks_per_node)


def _members(pair: tuple[int, ...], ranks_per_node: int) -> list[int]:
    return [n * ranks_per_node + r for n in pair for r in range(ranks_per_node)]


def _all_reduce_once(
    group: Any, members: list[int], cfg: CheckConfig, fault: Fault | None, device: torch.device, retime: bool
) -> tuple[bool, float]:
    """One timed all-reduce of the known payload in a pair's group: (sum correct, seconds)."""
    payload = torch.full((cfg.collective_elems,), float(dist.get_rank() + 1), device=device)
    if fault and fault.kind == "node-fail":
        payload.add_(torch.randn_like(payload))  # a NIC/driver that corrupts what it sends
    start = time.perf_counter()
    if fault and (fault.kind == "slow" or (fault.kind == "burst" and not retime)):
        time.sleep(0.01 * fault.factor)
    dist.all_reduce(payload, group=group)
    seconds = time.perf_counter() - start
    return bool(torch.allclose(payload, torch.full_like(payload, float(sum(m + 1 for m in members))))), seconds


def pair_round(
    pairs: list[tuple[int, int]], cfg: CheckConfig, node: int, ranks_per_node: int, device: torch.device
) -> tuple[bool, float]:
    """All-reduce inside each pair of nodes, one pair at a time so pairs do not compete for the
    host (on a real cluster they would not); returns this rank's (sum correct, fastest op seconds).
    Every rank creates every pair's group: new_group is collective over the world."""
    groups = [dist.new_group(_members(pair, ranks_per_node)) for pair in pairs]
    fault = cfg.fault if cfg.fault and cfg.fault.node == node else None
    ok, times = True, []
    for pair, group in zip(pairs, groups):
        if node in pair:
            for _ in range(cfg.collective_iters):
                right, seconds = _all_reduce_once(group, _members(pair, ranks_per_node), cfg, fault, device, False)
                ok, times = ok and right, [*times, seconds]
        dist.barrier()
    return ok, min(times) if times else 0.0


def _gather(values: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's row of floats, as a (world, len(values)) tensor on every rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows).cpu()


def _per_node(rows: torch.Tensor, ranks_per_node: int) -> list[torch.Tensor]:
    return [rows[n * ranks_per_node : (n + 1) * ranks_per_node] for n in range(rows.shape[0] // ranks_per_node)]


def neighbour_pairs(nodes: int) -> list[tuple[int, int]]:
    """0-1, 2-3, ...; with an odd count the last node waits for round 2 (groups must not overlap)."""
    return [(n, n + 1) for n in range(0, nodes - 1, 2)]


def isolation_pairs(suspects: list[int], healthy: list[int], speed: dict[int, float]) -> list[tuple[int, int]]:
    """Slowest suspect with fastest healthy node, and so on; healthy nodes are reused if needed."""
    if not healthy:
        return []
    by_slowness = sorted(suspects, key=lambda n: -speed[n])
    by_speed = sorted(healthy, key=lambda n: speed[n])
    pairs, used = [], set()
    for i, suspect in enumerate(by_slowness):
        partner = by_speed[i % len(by_speed)]
        if partner in used and len(by_speed) > len(used):
            partner = next(h for h in by_speed if h not in used)
        used.add(partner)
        pairs.append((suspect, partner))
    # One turn's groups are disjoint (a node answers for one pair a turn); keep the first use of each.
    disjoint, taken = [], set()
    for pair in pairs:
        if not taken & set(pair):
            disjoint.append(pair)
            taken |= set(pair)
    return disjoint


def isolation_turns(suspects: list[int], healthy: list[int], speed: dict[int, float]) -> list[list[tuple[int, int]]]:
    """Round 2 in turns of disjoint pairs until every suspect had a healthy partner: with fewer healthy
    nodes than suspects one partner serves several suspects in turn (pairs run one at a time anyway;
    CI saw a jittery round-1 pair beside a corrupt node leave a healthy suspect unpaired, called bad)."""
    turns, waiting = [], list(suspects)
    while waiting and healthy:
        turns.append(isolation_pairs(waiting, healthy, speed))
        waiting = [s for s in waiting if all(s != suspect for suspect, _ in turns[-1])]
    return turns


def round1_suspects(
    pair_ok: dict[tuple[int, int], bool], pair_s: dict[tuple[int, int], float], slow_factor: float
) -> set[tuple[int, int]]:
    """The round-1 pairs whose nodes round 2 re-tests: wrong sums, and pairs `slow_factor` × slower
    than the lower median correct pair. Lower: a corrupting pair's timing says nothing, the fastest
    pair alone makes ordinary jitter look like slowness, and the usual median of 2 pairs (4 nodes) is
    their mean, which a slow pair never exceeds 2× (CI missed a 20× slow pair so)."""
    correct = [pair_s[p] for p in pair_s if pair_ok[p]]
    reference = statistics.median_low(correct) if correct else min(pair_s.values())
    return {p for p in pair_s if not pair_ok[p] or pair_s[p] > slow_factor * reference}


def run_check(cfg: CheckConfig, ranks_per_node: int, device: torch.device) -> list[NodeReport]:
    """The whole check; call on every rank of an initialized world. Same result on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ranks_per_node:
        raise ValueError(f"world size {world} is not a multiple of ranks per node {ranks_per_node}")
    nodes, node = world // ranks_per_node, rank // ranks_per_node
    if nodes < 2:
        raise ValueError("the paired collective check needs at least 2 nodes")
    reports = [NodeReport(n) for n in range(nodes)]

    matmul = _burn_in_round(cfg, device, node, nodes, ranks_per_node)
    median_mm = statistics.median(float(m[:, 1].max()) for m in matmul)
    for n, rows in enumerate(matmul):
        r = reports[n]
        r.matmul_ok, r.matmul_s = bool(rows[:, 0].min() > 0), float(rows[:, 1].max())
        if not r.matmul_ok:
            r.reasons.append("matmul result differs from the reference (wrong numbers or NaN)")
    slow = [r for r in reports if r.matmul_s > cfg.slow_factor * median_mm]
    if slow:  # the same on every rank (gathered times): a second burn-in, and only slow in both counts
        again = [float(m[:, 1].max()) for m in _burn_in_round(cfg, device, node, nodes, ranks_per_node)]
        median_again = statistics.median(again)
        for r in slow:
            if again[r.node] > cfg.slow_factor * median_again:
                r.straggler = True
                r.reasons.append(
                    f"matmul {r.matmul_s / median_mm:.1f}× and {again[r.node] / median_again:.1f}× the median node"
                )

    round1 = neighbour_pairs(nodes)
    ok, seconds = pair_round(round1, cfg, node, ranks_per_node, device)
    rows1 = _per_node(_gather([float(ok), seconds], device), ranks_per_node)
    pair_of = {n: pair for pair in round1 for n in pair}
    pair_ok = {pair: all(bool(rows1[n][:, 0].min() > 0) for n in pair) for pair in round1}
    pair_s = {pair: max(float(rows1[n][:, 1].max()) for n in pair) for pair in round1}
    suspect_pairs = round1_suspects(pair_ok, pair_s, cfg.collective_slow_factor)
    suspects = []
    for n in range(nodes):
        r, pair = reports[n], pair_of.get(n)
        if pair is None:  # the odd node out: tested in round 2
            suspects.append(n)
            continue
        r.round1_pair, r.round1_ok, r.round1_s = list(pair), pair_ok[pair], pair_s[pair]
        if pair in suspect_pairs:
            suspects.append(n)
    healthy = [n for n in range(nodes) if n not in suspects and reports[n].matmul_ok]

    pair_times = []
    for turn in isolation_turns(suspects, healthy, {n: reports[n].round1_s for n in range(nodes)}):
        ok, seconds = pair_round(turn, cfg, node, ranks_per_node, device)
        rows2 = _per_node(_gather([float(ok), seconds], device), ranks_per_node)
        for suspect, partner in turn:
            r = reports[suspect]
            r.round2_pair = [suspect, partner]
            r.round2_ok = bool(rows2[suspect][:, 0].min() > 0 and rows2[partner][:, 0].min() > 0)
            r.round2_s = max(float(rows2[suspect][:, 1].max()), float(rows2[partner][:, 1].max()))
            pair_times.append(r.round2_s)
    # Judge round 2 against typical pairs: the healthy round-1 pairs and all round-2 pairs. A median
    # shrugs off the one slow pair and the host's noise (pairs on a shared 2-core box vary 3×).
    typical = statistics.median([pair_s[p] for p in round1 if not set(p) & set(suspects)] + pair_times or [0.0])
    slow = [n for n in suspects if reports[n].round2_ok and reports[n].round1_ok]
    slow = [n for n in slow if reports[n].round2_s > cfg.collective_slow_factor * typical]
    reference = [p for p in round1 if not set(p) & set(suspects)]
    # suspect → its factor beside a healthy pair (None: no healthy pair to retime it beside)
    retimed: dict[int, float | None] = dict.fromkeys(slow)
    if slow and reference:
        retimed = _slow_when_retimed(slow, reports, reference, cfg, node, ranks_per_node, device)
    for n in suspects:
        r = reports[n]
        if r.round2_ok is None:
            r.ok = False
            r.reasons.append(
                f"collective in pair {r.round1_pair} failed or was slow and no healthy node was left to isolate it"
            )
        elif not r.round2_ok:
            r.ok = False
            r.reasons.append("collective result wrong in both rounds")
        elif n in retimed:
            # slow in both rounds (or the odd node out, tested once) and when timed again beside a healthy
            # pair: the partner of a corrupting node was a suspect for the wrong sum, and a slow round-2
            # pair on a loaded host is no straggler (CI: a load burst covered both rounds)
            r.straggler = True
            beside = f", {retimed[n]:.1f}× a healthy pair timed beside it" if retimed[n] is not None else ""
            r.reasons.append(f"collective {r.round2_s / typical:.1f}× the typical pair in both rounds{beside}")
    for r in reports:
        r.ok = r.ok and r.matmul_ok
    return reports


def _slow_when_retimed(
    slow: list[int],
    reports: list[NodeReport],
    reference: list[tuple[int, int]],
    cfg: CheckConfig,
    node: int,
    ranks_per_node: int,
    device: torch.device,
) -> dict[int, float | None]:
    """The suspects whose round-2 pair stays `collective_slow_factor` × slower than the healthy round-1
    pairs when timed again beside them (`RETIMES` × the usual ops), each with that factor. Each
    iteration times the suspect's pair and then each reference pair back to back, and the median over
    the iterations of their ratio is what is judged: a burst of load on a shared host slows both sides
    of one ratio, and the median ignores the iterations a burst split. (Comparing each side's fastest
    op failed under a load that left the suspect's pair no fast op in 30 while a reference had one.)"""
    fault = cfg.fault if cfg.fault and cfg.fault.node == node else None
    iters = RETIMES * cfg.collective_iters
    still: dict[int, float | None] = {}
    for n in slow:
        pairs = [tuple(reports[n].round2_pair or ()), *reference]
        assert len(pairs[0]) == 2, pairs
        groups = [dist.new_group(_members(p, ranks_per_node)) for p in pairs]
        seconds = [[0.0] * iters for _ in pairs]  # this rank's op times per pair and iteration (0: not a member)
        for it in range(iters):
            for i, (pair, group) in enumerate(zip(pairs, groups)):
                if node in pair:
                    members = _members(pair, ranks_per_node)
                    _, seconds[i][it] = _all_reduce_once(group, members, cfg, fault, device, True)
                dist.barrier()
        rows = _gather([t for per_pair in seconds for t in per_pair], device).view(-1, len(pairs), iters)
        # an op of a pair took as long as its slowest member saw it take
        per_pair = [rows[_members(p, ranks_per_node), i].amax(dim=0) for i, p in enumerate(pairs)]
        ratio = float((per_pair[0] / torch.stack(per_pair[1:]).median(dim=0).values).median())
        if ratio > cfg.collective_slow_factor:
            still[n] = ratio
    return still


def summarize(reports: list[NodeReport]) -> dict[str, Any]:
    return {
        "ok": all(r.ok and not r.straggler for r in reports),
        "bad_nodes": [r.node for r in reports if not r.ok],
        "stragglers": [r.node for r in reports if r.straggler],
        "nodes": [asdict(r) for r in reports],
    }
