"""The simulated keepers, mixed into ``sim.World``: pins and plans, writes, peer copies, and a keeper's
death and start (docs/protocol.md)."""

from __future__ import annotations

from typing import Any

from stalwart.checkpoint import decider_events as ev
from tests.protocol.sim_state import Key, Node, Rank, published


class Keepers:
    """The keepers' side of ``sim.World`` (its fields are the world's)."""

    nodes: dict[str, Node]
    ranks: dict[int, Rank]
    epoch: int
    shards: dict[tuple[int, int], dict[int, tuple[Key, bool]]]
    from_copies: int
    declared: tuple[int, float, int] | None

    def _to_copy(self, node: Node) -> list[int]:
        """Own ranks whose newest published snapshot the peer (its keeper up) lacks. Copies stop when
        the execution fails: a node's final holdings, sent when its workers are gone, stay final."""
        peer = self.peer(node)
        if peer is None or not peer.keeper_up:
            return []
        out = []
        for r in node.ranks:
            done = published(self.ranks[r])
            if done and max(done) != node.pushed.get(r):
                out.append(r)
        return out

    def copy(self, name: str, r: int) -> None:
        node = self.nodes[name]
        peer, rank = self.peer(node), self.ranks[r]
        key = max(published(rank))
        node.pushed[r] = key
        slots = peer.copies.setdefault(r, [None, None])
        free = [i for i, k in enumerate(slots) if k is None or k not in peer.pins]
        if free:  # else both copies are pinned: this one is skipped
            slots[min(free, key=lambda i: -1 if slots[i] is None else slots[i][0])] = key
            self.report(peer)

    def deliver(self, i: int) -> None:
        dest, msg = self.net.pop(i)
        if dest == "decider":
            self.decide(msg)
        elif dest == "agents":
            if msg.failed_epoch == self.epoch:
                self.may_restart = msg
        elif (node := self.nodes.get(dest)) is not None and node.up:  # a lost node's mail is dropped
            self.keeper_handle(node, msg)

    def keeper_handle(self, node: Node, msg: Any) -> None:
        if isinstance(msg, ev.Release):
            if msg.free:
                for r in node.ranks:
                    self.ranks[r].slots = [None, None]
                node.copies = {}
            for key, plan in list(node.pins.items()):
                if (msg.key is None or key == msg.key) and plan <= msg.upto:
                    del node.pins[key]
            if node.sight not in node.pins:
                node.sight = None
            if node.task is not None and node.task[2] not in node.pins:
                node.task, node.todo = None, []  # an unpinned snapshot is no longer written
            return
        if isinstance(msg, ev.Commit):
            node.commits.append((msg.plan, msg.step))
            return
        if isinstance(msg, ev.Write):  # every node pinned: each plans the same layout, writes its share
            if node.task is not None and node.task[:2] == (msg.plan, msg.attempt) and msg.key in node.pins:
                node.todo = list(node.mine)
            return
        if (msg.plan, msg.attempt) <= node.last_plan:
            return  # a late or repeated plan: the keeper has moved on
        node.last_plan = (msg.plan, msg.attempt)
        key = msg.key
        mine = dict(msg.writers).get(node.name, tuple(node.ranks))
        holds = all(self.has(node, r, key) for r in mine)
        if holds and self._moved_on(node, key):
            holds = False
        if not holds:
            self.to_decider(ev.Pinned(node.name, msg.plan, False, "not held"))
            return
        node.pins[key] = max(msg.plan, node.pins.get(key, 0))
        self.report(node)  # its pins too: one the decider no longer wants (a late plan) is released
        node.task, node.mine, node.todo = (msg.plan, msg.attempt, key), list(mine), []
        self.to_decider(ev.Pinned(node.name, msg.plan, True, attempt=msg.attempt))

    def _moved_on(self, node: Node, key: Key) -> bool:
        """Old design: a cursor past ``key`` answers "missing", unless the cursor's snapshot is a dead end."""
        c, declared = node.cursor, self.declared
        if c is None or c[0] <= key[0] or 0 in node.ranks:  # the coordinator reads the others' cursors
            return False
        if declared is not None:
            if self.rules.dead_end_by_clock and c[0] > declared[0] and c[2] < declared[1]:  # by two clocks
                return False
            if self.rules.dead_end_by_epoch and c[1] <= declared[2]:  # of the failed execution: integers
                return False
        return True

    def write(self, name: str) -> None:
        node = self.nodes[name]
        plan, attempt, key = node.task
        r = node.todo.pop()
        self.shards.setdefault((key[0], plan), {})[r] = (key, True)
        self.from_copies += r not in node.ranks  # a lost node's rank, written from a peer's copy
        if not node.todo:
            if node.cursor is not None and node.cursor[0] == key[0]:
                node.cursor = None
            self.to_decider(ev.Wrote(name, plan, attempt, True))

    def storage_fails(self, name: str) -> None:
        node = self.nodes[name]
        self.excuse()
        self.to_decider(ev.Wrote(name, node.task[0], node.task[1], False, "storage failed"))
        node.todo = []

    def kill_keeper(self, name: str, mid_write: bool) -> None:
        node = self.nodes[name]
        node.keeper_up, node.pins, node.sight = False, {}, None  # its flocks die with it
        node.commits = []  # a commit it was told to make: the decider hears of the restart
        self.excuse()
        if mid_write:
            plan, _, key = node.task
            self.shards.setdefault((key[0], plan), {})[node.todo[-1]] = (key, False)  # torn shard
        node.todo, node.task = [], None

    def keeper_start(self, name: str) -> None:
        node = self.nodes[name]
        node.keeper_up, node.incarnation = True, node.incarnation + 1
        self.report(node)

    def dead_seen_again(self, name: str) -> None:
        """The keeper reads its dead workers' records once more after the next execution formed, before its
        new workers replaced them (its loop made the call that formed it in between): it reports them
        again, stamped with their own execution — or, by the old rule, with job.json's, now the new one."""
        node = self.nodes[name]
        epoch = self.epoch if self.rules.gone_epoch_from_job else node.dead_epoch
        node.dead_epoch = None
        self.to_decider(ev.WorkersGone(name, epoch, self.holdings(node)))
