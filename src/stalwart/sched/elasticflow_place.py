"""Node placement and the communicator cache of ElasticFlow's simulator, reimplemented (read, not copied).

Why it matters for Fig. 8b: ElasticFlow charges a running job ``2 * (log2(GPUs) + 1)`` s of scaling
overhead in a round unless the job's *rank range* (first global GPU rank, GPU count) is in a cache
shared by all jobs; the cache is emptied every 60 rounds (when trainers restart). Ranks come from the
placement, which is redone from an empty cluster every round, so a job's range moves whenever jobs
placed before it change, and a job can also hit a range another job used earlier.

The placement ("elastic" scheme): every round all jobs are released in deadline order (a node goes back
to the free list when its last job leaves; the free list is kept sorted by per-switch node id, ties in
the order the nodes came back), then jobs are placed by GPU count, largest first: a job of 8 GPUs or
more takes whole nodes from the head of the free list; a smaller job goes to the least-used partly free
node of its size class, else fills a node of a larger class, else opens a new node. Global ranks follow
the physical order (switch by switch, node by node, jobs inside a node in the order they were put
there), so on multi-switch clusters a job's nodes need not be adjacent in rank order."""

from __future__ import annotations

from dataclasses import dataclass, field

GPUS_PER_NODE = 8
SMALL_KEYS = (4, 2, 1)  # size classes below a node, largest first


@dataclass
class _NodeSet:
    nodes: list[tuple[int, int]]  # (switch, per-switch node id)
    cap: int
    util: int = 0
    jobs: list[tuple[int, int]] = field(default_factory=list)  # (job idx, GPUs), in placement order


def _key(free: int) -> int:
    """The size class a node with ``free`` idle GPUs is listed under (free is 1..7)."""
    return next(k for k in SMALL_KEYS if free % k == 0)


class Placement:
    """The cluster's node layout across rounds plus the rank-range cache (see the module docstring)."""

    def __init__(self, gpus: int, switches: int) -> None:
        nodes = gpus // GPUS_PER_NODE
        if switches < 1 or nodes % switches:
            raise ValueError(f"{nodes} nodes do not split over {switches} switches")
        self.per_switch = nodes // switches
        self._seq = 0
        # free nodes as (node id, order of return, switch): sorted == ElasticFlow's stable sort by id
        self.free: list[tuple[int, int, int]] = []
        for s in range(switches):
            for n in range(self.per_switch):
                self._give_back((s, n))
        self.sets: dict[int, _NodeSet] = {}  # job idx -> its node set
        self.cache: set[tuple[int, int]] = set()

    def _give_back(self, node: tuple[int, int]) -> None:
        self.free.append((node[1], self._seq, node[0]))
        self._seq += 1

    def round(self, release_order: list[int], place: list[tuple[int, int]]) -> dict[int, bool]:
        """Release every placed job (jobs that ended, then ``release_order``: by deadline), place ``place``
        ((job idx, GPUs), already in ElasticFlow's order) and return, per placed job, whether its rank
        range was cached (the misses are added to the cache)."""
        released = False
        keep = set(release_order)
        ended = [idx for idx in self.sets if idx not in keep]
        for idx in ended + release_order:  # jobs that ended go first, as in ElasticFlow
            ns = self.sets.pop(idx, None)
            if ns is None:
                continue
            ns.util -= next(g for j, g in ns.jobs if j == idx)
            ns.jobs = [(j, g) for j, g in ns.jobs if j != idx]
            if ns.util == 0:
                for node in ns.nodes:
                    self._give_back(node)
                released = True
        if released:  # ElasticFlow re-sorts its free list by node id only when nodes come back
            self.free.sort()
        assert not self.sets, "a placed job was not released"
        lists: dict[int, list[_NodeSet]] = {k: [] for k in SMALL_KEYS}
        big: list[_NodeSet] = []
        for idx, g in place:
            ns = self._place_big(g) if g >= GPUS_PER_NODE else self._place_small(lists, g)
            ns.jobs.append((idx, g))
            self.sets[idx] = ns
            if g >= GPUS_PER_NODE:
                big.append(ns)
        hits: dict[int, bool] = {}
        small = [ns for k in SMALL_KEYS for ns in lists[k]]
        for ns in big + small:
            first = min(s * self.per_switch + n for s, n in ns.nodes) * GPUS_PER_NODE
            for idx, g in ns.jobs:
                rng = (first, g)
                hits[idx] = rng in self.cache
                self.cache.add(rng)
                first += g
        return hits

    def _take(self, n: int) -> list[tuple[int, int]]:
        if n > len(self.free):
            raise AssertionError(f"placement needs {n} nodes, {len(self.free)} free")
        taken, self.free = self.free[:n], self.free[n:]
        return [(s, i) for i, _, s in taken]

    def _place_big(self, g: int) -> _NodeSet:
        n = -(-g // GPUS_PER_NODE)
        return _NodeSet(self._take(n), n * GPUS_PER_NODE, g)

    def _place_small(self, lists: dict[int, list[_NodeSet]], g: int) -> _NodeSet:
        own = lists[g]
        if own:  # the least-used node of its own class, if it fits
            ns = own.pop(0)
            if ns.util + g <= ns.cap:
                self._fill(lists, own, ns, g)
                return ns
            own.append(ns)
        for k in SMALL_KEYS:  # else a node listed under a larger class
            if k <= g or not lists[k]:
                continue
            ns = lists[k].pop(0)
            if ns.util + g <= ns.cap:
                self._fill(lists, own, ns, g)
                return ns
            lists[k].append(ns)
        ns = _NodeSet(self._take(1), GPUS_PER_NODE)
        self._fill(lists, own, ns, g)
        return ns

    @staticmethod
    def _fill(lists: dict[int, list[_NodeSet]], own: list[_NodeSet], ns: _NodeSet, g: int) -> None:
        ns.util += g
        free = ns.cap - ns.util
        target = lists[_key(free)] if free > 0 else own
        target.append(ns)
        own.sort(key=lambda s: s.util)
        if target is not own:
            target.sort(key=lambda s: s.util)

    def restart(self) -> None:
        """Trainers restart: the cache is emptied."""
        self.cache.clear()


def switches_for(gpus: int) -> int:
    """Switch count of ElasticFlow's cluster specs: n64g8 has two switches of 32 nodes, the others one."""
    return 2 if gpus == 512 else 1
