"""The memory tier's ledger on the job's controller: which rank's snapshot of which step is held by
which node's keeper (and its replica), and which step a restarted group can take back whole.

A mixin of `JobController`: its methods are the controller's (ranks call them through
`client.ControllerClient`), under its lock.
"""

from __future__ import annotations

import sys

from ..calls import tell
from ..checkpoint.keeper import MemoryKeeper


class SnapshotLedger:
    def __init__(self, keepers: dict | None):
        # node -> its MemoryKeeper (none: the controller keeps the snapshots itself, as in the in-process harness);
        # step -> (world size, rank -> node) of the snapshots sent for it, and (step, rank) -> the node of its replica.
        self.keepers = keepers or {}
        self.snapshots: dict[int, tuple[int, dict[int, str]]] = {}
        self.replicas: dict[tuple[int, int], str] = {}
        self.settled: int | None = None

    def memory_step(self, world: int) -> int | None:
        """The newest step newer than the last commit whose snapshot every rank of a group of
        `world` ranks can take back: on a node that is alive, its own or its replica."""
        committed = self.last_committed()
        alive = self._alive_nodes()
        for step in sorted(self.snapshots, reverse=True):
            size, ranks = self.snapshots[step]
            if size != world or len(ranks) < world or (committed is not None and step <= committed):
                continue
            if alive is None or all({ranks[r], self.replicas.get((step, r))} & alive for r in ranks):
                return step
        return None

    def _alive_nodes(self) -> set | None:
        """The nodes alive now (None: no keeper is a Ray actor, so none can be lost)."""
        ray = sys.modules.get("ray")  # a keeper that is an actor handle exists only where Ray is imported
        if ray is None or not any(isinstance(k, ray.actor.ActorHandle) for k in self.keepers.values()):
            return None
        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def settled_step(self) -> int | None:
        """The newest snapshot that outlives the loss of any one node: complete for every rank and,
        with more than one keeper, replicated for every rank (older ones are dropped then)."""
        return self.settled

    def keeper_for(self, node: str):
        """The MemoryKeeper of `node` (any node's, if it has none: one that joined after the start;
        None: this object keeps the snapshots itself)."""
        return self.keepers.get(node) or next(iter(self.keepers.values()), None)

    def snapshot_keepers(self, step: int, rank: int) -> list:
        """The keepers holding `rank`'s snapshot of `step`: its node's, then the replica's, if any."""
        nodes = [self.snapshots[step][1][rank], self.replicas.get((step, rank))]
        return [self.keeper_for(node) for node in nodes if node]

    def replicated(self, step: int, rank: int, node: str) -> None:
        with self.lock:
            if step not in self.snapshots:
                return
            self.replicas[(step, rank)] = node
        self._settle(step)

    def snapshotted(self, step: int, rank: int, world: int, node: str) -> None:
        """`rank` of a group of `world` ranks sent its snapshot of `step` to the keeper of `node`."""
        with self.lock:
            size, ranks = self.snapshots.get(step, (world, {}))
            if size != world:  # the step again, in a group of another size: its snapshots replace the old ones
                ranks = {}
            self.snapshots[step] = (world, ranks)
            ranks[rank] = node
        self._settle(step)

    def _settle(self, step: int) -> None:
        """Once `step` is complete, only it and the newest settled step (see `settled_step`) can
        still be resumed; once it is settled too, only it: every keeper drops the others. A node
        lost before a complete step's replicas are in leaves the settled one to resume from."""
        with self.lock:
            size, ranks = self.snapshots.get(step, (0, {}))
            if len(ranks) < size or size == 0 or step < (self.settled or 0):
                return
            if len(self.keepers) < 2 or all((step, r) in self.replicas for r in ranks):
                self.settled = step
            keep = self.settled
            for older in [s for s in self.snapshots if s < step and s != keep]:
                del self.snapshots[older]
            self.replicas = {key: node for key, node in self.replicas.items() if key[0] in self.snapshots}
        for keeper in self.keepers.values() or [self]:
            tell(keeper, MemoryKeeper.drop_before, step, keep)

    def snapshot_lost(self, step: int) -> None:
        """A rank could not fetch its snapshot of `step` (its node is gone): never offered again."""
        with self.lock:
            self.snapshots.pop(step, None)
            if self.settled == step:
                self.settled = None
