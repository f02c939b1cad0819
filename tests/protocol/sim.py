"""One simulated multi-node job around the decider: workers, keepers, agents and rendezvous, storage and
the network, as plain data in one process. ``World.actions()`` lists what may happen next (normal steps
and fault points); ``explore.py`` picks one by a seeded choice. No threads, no clocks: ``now`` is a
counter of simulated seconds, advanced a little by each step and jumped only by a timer (which the new
decider never sets, so a jump is how a wait without an event shows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider import Decider
from tests.protocol.invariants import StorageAndChecks
from tests.protocol.old_design import NEW, OldDecider, OldRules, StartTimer
from tests.protocol.sim_keepers import Keepers
from tests.protocol.sim_state import Key, Node, Rank, published

TICK_S = 0.05  # simulated seconds per step
Action = tuple[str, Callable[..., None], tuple[Any, ...]]


class World(Keepers, StorageAndChecks):
    def __init__(self, n_nodes: int, per_node: int, steps: int, every: int, restarts: int, rules: OldRules = NEW,
                 skew: float = 0.0) -> None:  # fmt: skip
        self.rules, self.steps, self.every, self.restarts = rules, steps, every, restarts
        self.now, self.epoch, self.spares = 0.0, 0, 0
        self.nodes: dict[str, Node] = {}
        self.ranks: dict[int, Rank] = {}
        for i in range(n_nodes):
            name = chr(ord("A") + i)
            rs = list(range(i * per_node, (i + 1) * per_node))
            self.nodes[name] = Node(name, rs, skew=skew if i > 0 else 0.0)  # rank 0's node: the true clock
            for r in rs:
                self.ranks[r] = Rank(r, name)
        nodes = {n.name: n.ranks for n in self.nodes.values()}
        self.decider: Decider = OldDecider(nodes, rules) if rules != NEW else Decider(nodes)
        self.net: list[tuple[str, Any]] = []  # (destination: node, "decider" or "agents", message)
        self.timers: list[tuple[float, str]] = []
        self.plans: dict[int, Key] = {}
        self.plan_nodes: dict[int, tuple[str, ...]] = {}
        self.plan_writers: dict[int, dict[str, tuple[int, ...]]] = {}
        self.failure_plans: set[int] = set()
        self.saved_on_failure = 0
        self.shards: dict[tuple[int, int], dict[int, tuple[Key, bool]]] = {}  # (step, plan) → rank → shard
        self.latest: int | None = None
        self.committed: list[int] = []
        self.failing = False  # the current execution failed (a rank died, a node was lost, a notice)
        self.preempted = False
        self.may_restart: ev.RestartMayProceed | None = None
        self.failure_truth: Key | None = None  # the newest key every rank held when the execution ended
        self.excused = False  # a fault since the failure that may cost the save (node, keeper, storage)
        self.saves: list[dict[str, Any]] = []  # per failure: the step to save, latest then, excused
        self.declared: tuple[int, float, int] | None = None  # old: rank 0's node's (newest, started, epoch)
        self.ended = False
        self.given_up: list[tuple[int, str]] = []  # the decider's GiveUp decisions
        self.busy: set[int] = set()  # due steps a node could not pin on sight (it held another)
        self.from_copies = 0  # shards written from peer copies
        self.trace: list[str] = []
        self.fault_log: list[str] = []

    # -- plumbing ------------------------------------------------------------------------------
    def send(self, dest: str, msg: Any) -> None:
        self.net.append((dest, msg))

    def to_decider(self, event: Any) -> None:
        self.send("decider", event)

    def holdings(self, node: Node) -> ev.Held:
        by_key: dict[Key, list[int]] = {}
        for r in node.ranks:
            for key in published(self.ranks[r]):
                by_key.setdefault(key, []).append(r)
        for r, slots in node.copies.items():  # peer copies of other nodes' ranks
            for key in {k for k in slots if k is not None}:
                by_key.setdefault(key, []).append(r)
        return tuple((k[0], k[1], tuple(sorted(rs)), k in node.pins) for k, rs in sorted(by_key.items()))

    def has(self, node: Node, r: int, key: Key) -> bool:
        """``node`` holds rank ``r``'s snapshot ``key``: its own, published, or a peer copy of it."""
        return key in (published(self.ranks[r]) if r in node.ranks else node.copies.get(r, ()))

    def peer(self, node: Node) -> Node | None:
        """Where ``node``'s keeper copies its ranks' snapshots: the next node up, by name."""
        names = sorted(n for n, x in self.nodes.items() if x.up)
        if len(names) < 2 or node.name not in names:
            return None
        return self.nodes[names[(names.index(node.name) + 1) % len(names)]]

    def report(self, node: Node) -> None:
        node.seq += 1
        self.to_decider(ev.Holding(node.name, node.incarnation, node.seq, self.holdings(node)))

    def world_ranks(self) -> list[Rank]:
        return list(self.ranks.values())

    # -- the decider's side ---------------------------------------------------------------------
    def decide(self, event: Any) -> None:
        for d in self.decider.handle(event):
            if isinstance(d, ev.Persist):
                self.plans[d.plan], self.plan_nodes[d.plan] = d.key, d.nodes
                self.plan_writers[d.plan] = dict(d.writers)
                if d.failure:
                    self.failure_plans.add(d.plan)
                for n in d.nodes:
                    self.send(n, d)
                if d.failure and self.declared is None:  # old design: .stage/failure.json
                    first = self.nodes[self.ranks[0].node]
                    held = [k[0] for r in first.ranks for k in self.ranks[r].slots if k]
                    self.declared = (max(held, default=-1), self.now + first.skew, self.epoch)
            elif isinstance(d, ev.Write):
                for n in self.plan_nodes.get(d.plan, ()):
                    self.send(n, d)
            elif isinstance(d, ev.Commit):  # the node writing rank 0 commits
                self.send(next(n for n, rs in self.plan_writers[d.plan].items() if 0 in rs), d)
            elif isinstance(d, ev.GiveUp):
                self.given_up.append((d.step, d.why))
            elif isinstance(d, ev.Release):
                for n in [d.node] if d.node else list(self.nodes):
                    self.send(n, d)
            elif isinstance(d, ev.RestartMayProceed):
                self.send("agents", d)
            elif isinstance(d, StartTimer):
                self.timers.append((self.now + d.seconds, d.token))

    # -- actions --------------------------------------------------------------------------------
    def actions(self, faults: bool) -> list[Action]:
        acts: list[Action] = []
        for i, (dest, _) in enumerate(self.net):
            node = self.nodes.get(dest)
            if node is None or node.keeper_up:
                acts.append(("deliver", self.deliver, (i,)))
        low = min(r.trained for r in self.ranks.values())
        for rank in self.ranks.values():
            if rank.copying is not None and rank.alive:
                acts.append(("publish", self.publish, (rank.rank,)))
            elif self._may_train(rank, low):
                acts.append(("train", self.train, (rank.rank,)))
        for node in self.nodes.values():
            if node.keeper_up and node.todo:
                acts.append(("write", self.write, (node.name,)))
            if node.up and node.keeper_up and not self.failing and not self.ended:
                acts.extend(("copy", self.copy, (node.name, r)) for r in self._to_copy(node))
            if self.failing and node.up and not node.stopped:
                acts.append(("stop", self.stop_workers, (node.name,)))
            if not node.keeper_up and node.up:
                acts.append(("keeper-start", self.keeper_start, (node.name,)))
            if node.up and node.keeper_up and node.dead_epoch is not None and node.dead_epoch < self.epoch:
                acts.append(("gone-again", self.dead_seen_again, (node.name,)))
        for node in self.nodes.values():
            if node.keeper_up and node.commits:
                acts.append(("commit", self.commit, (node.name, False)))
        if not self.ended:
            if self._may_rendezvous():
                acts.append(("rendezvous", self.rendezvous, ()))
            if self._may_end():
                acts.append(("end", self.end, ()))
        if faults and not self.ended:
            acts.extend(self.fault_actions())
        return acts

    def fault_actions(self) -> list[Action]:
        acts: list[Action] = []
        for rank in self.ranks.values():
            if rank.alive and rank.copying is not None:
                acts.append(("kill-rank-mid-copy", self.kill_rank, (rank.rank,)))
        for node in self.nodes.values():
            if node.up and node.keeper_up:
                acts.append(("kill-keeper", self.kill_keeper, (node.name, bool(node.todo))))
            if node.up and len(self.nodes) > 1:
                acts.append(("lose-node", self.lose_node, (node.name,)))
            if node.todo:
                acts.append(("storage-fails", self.storage_fails, (node.name,)))
        if self.net:
            acts.append(("duplicate", self.duplicate, (len(self.net) - 1,)))
        for node in self.nodes.values():
            if node.keeper_up and node.commits:
                acts.append(("commit-fails", self.commit, (node.name, True)))
        if not self.preempted:
            acts.append(("preempt", self.preempt, ()))
        return acts

    # workers
    def _may_train(self, rank: Rank, low: int) -> bool:
        """In lockstep: a rank trains step s+1 once every rank trained s, into a slot not pinned."""
        ok = not self.failing and not self.ended and rank.trained < self.steps and rank.trained == low
        return ok and self._free_slot(rank) is not None

    def _free_slot(self, rank: Rank) -> int | None:
        pins = self.nodes[rank.node].pins
        free = [i for i, k in enumerate(rank.slots) if k is None or k not in pins]
        return min(free, key=lambda i: -1 if rank.slots[i] is None else rank.slots[i][0]) if free else None

    def train(self, r: int) -> None:
        rank = self.ranks[r]
        self.nodes[rank.node].dead_epoch = None  # the new workers' owner records replaced the dead ones'
        rank.trained += 1
        slot = self._free_slot(rank)
        rank.copying, rank.slots[slot] = slot, (rank.trained, self.epoch)
        rank.taken[slot] = self.now + self.nodes[rank.node].skew

    def publish(self, r: int) -> None:
        rank = self.ranks[r]
        rank.copying = None
        node = self.nodes[rank.node]
        step = rank.trained
        due, key = step % self.every == 0 or step == self.steps, (step, self.epoch)
        if due and node.keeper_up and self.rules.pin_on_sight:  # held until the decider's word
            if node.sight in (None, key):  # one at a time, as the keepers do
                node.pins.setdefault(key, 0)
                node.sight = key
            else:
                self.busy.add(step)  # its node still holds another on sight: it may be given up
        self.report(node)
        if due and r == node.ranks[0]:
            self.to_decider(ev.PersistDue(step, self.epoch))
            if self.rules.cursor_moved_on:  # the old keeper began persisting it on its own
                node.cursor = (step, self.epoch, rank.taken[rank.slots.index((step, self.epoch))])

    def kill_rank(self, r: int) -> None:
        rank = self.ranks[r]
        rank.alive, self.failing = False, True
        if rank.copying is not None:
            rank.slots[rank.copying], rank.copying = None, None  # torn

    # agents and membership
    def stop_workers(self, name: str) -> None:
        node = self.nodes[name]
        for r in node.ranks:
            rank = self.ranks[r]
            if rank.copying is not None:
                rank.slots[rank.copying], rank.copying = None, None
            rank.alive = False
        node.stopped, node.dead_epoch = True, self.epoch
        self.to_decider(ev.WorkersGone(name, self.epoch, self.holdings(node)))
        if all(n.stopped or not n.up for n in self.nodes.values()):
            self.failure_truth = self._common()
            if self.failure_truth is not None and not self.excused:
                self.saves.append({"key": self.failure_truth, "floor": self.latest, "excused": False})

    def _common(self) -> Key | None:
        by_key: dict[Key, set[int]] = {}
        for node in self.nodes.values():
            if node.up:
                for step, epoch, ranks, _ in self.holdings(node):
                    by_key.setdefault((step, epoch), set()).update(ranks)
        full = [k for k, rs in by_key.items() if len(rs) == len(self.ranks)]
        return max(full) if full else None

    def lose_node(self, name: str) -> None:
        node = self.nodes[name]
        node.up, node.keeper_up, node.pins, node.todo, node.copies = False, False, {}, [], {}
        node.commits = []  # its commit in flight goes with it
        for r in node.ranks:
            self.ranks[r].alive, self.ranks[r].slots, self.ranks[r].copying = False, [None, None], None
        self.failing = True
        # What survives (peer copies included) is judged when every node's workers are gone; once that
        # was judged, the loss may cost the save in flight.
        self.excuse(current=self.failure_truth is not None)
        self.net = [(d, m) for d, m in self.net if d != name]  # its own word may still arrive
        self.decide(ev.NodeLost(name, self.epoch))  # membership is the decider's own (the master)
        self.fault_log.append(f"node {name} lost at {self.now:.2f}")

    def preempt(self) -> None:
        self.preempted, self.failing = True, True
        self.to_decider(ev.Preempted(self.epoch))

    def duplicate(self, i: int) -> None:
        self.net.append(self.net[i])

    def _all_stopped(self) -> bool:
        return all(n.stopped or not n.up for n in self.nodes.values())

    def _may_rendezvous(self) -> bool:
        return (self.failing and not self.preempted and self.restarts > 0 and self._all_stopped()
                and self.may_restart is not None)  # fmt: skip

    def rendezvous(self) -> None:
        self.check_restart_saved()
        self.restarts -= 1
        self.epoch += 1
        for node in list(self.nodes.values()):
            if not node.up:  # a spare takes the lost node's ranks, with empty memory
                self.spares += 1
                del self.nodes[node.name]
                spare = Node(f"S{self.spares}", node.ranks, skew=node.skew)
                self.nodes[spare.name] = spare
                for r in spare.ranks:
                    self.ranks[r].node = spare.name
            node.stopped = False
        start = self._restore_step()
        for rank in self.ranks.values():
            rank.alive, rank.trained, rank.copying = True, start, None
        self.failing, self.may_restart, self.excused, self.failure_truth = False, None, False, None
        self.declared = None
        self.decide(ev.EpochBegan(self.epoch, tuple((n.name, tuple(n.ranks)) for n in self.nodes.values())))

    def _restore_step(self) -> int:
        """Memory when every rank holds the step the decider named (or, without one, the newest agreed),
        else storage's latest, else step 0."""
        key = self.may_restart.key if self.may_restart and self.may_restart.key else self._common()
        up = [n for n in self.nodes.values() if n.up]
        if key is not None and all(any(self.has(n, r, key) for n in up) for r in self.ranks):
            self.restored = key[0]  # from memory: a rank's own snapshot, or a peer's copy of it
        else:
            self.restored = self.latest or 0
        return self.restored

    def _may_end(self) -> bool:
        if not self.decider.idle() or any(d == "decider" for d, _ in self.net):
            return False
        if self.failing:
            if not self._all_stopped() or (self.restarts > 0 and not self.preempted):
                return False
            if self.preempted and self.rules.preempt_waits_own_newest and not self._own_newest_committed():
                return False
            return self.may_restart is not None
        return all(r.trained == self.steps and r.copying is None for r in self.ranks.values())

    def _own_newest_committed(self) -> bool:
        for node in self.nodes.values():
            held = [k[0] for r in node.ranks for k in self.ranks[r].slots if k] if node.up else []
            if held and (self.latest is None or self.latest < max(held)):
                if not any(t[1] == "killwait" for t in self.timers):
                    self.timers.append((self.now + 90.0, "killwait"))  # Slurm's KillWait after the requeue
                return False
        return True

    def end(self) -> None:
        if self.failing:
            self.check_restart_saved(final=True)
        self.ended = True
        self.to_decider(ev.JobEnded())
