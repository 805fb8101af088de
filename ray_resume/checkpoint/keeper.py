"""The memory tier's keeper: an actor on every node that holds its ranks' snapshots in Ray's object
store, owned by itself, so that they outlive the workers that sent them (checkpoint.memory).

Apart from checkpoint.memory, which packs and unpacks the snapshots with torch: a keeper's process
imports no torch, so that the driver's keepers start in about a second beside the first group.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from ..calls import tell

ATTACH_S = 60.0


Packed = dict[str, tuple[str, list[int], Any]]  # name -> (dtype, shape, its bytes as a numpy array): memory.pack


@dataclass(frozen=True)
class Snapshot:
    """One rank's whole state at a step, as the memory tier holds it (made by `Checkpointer.snapshot`,
    taken back by `Checkpointer.restore_snapshot`; defined here, where no torch is, for the keepers)."""

    model: Packed
    optim: Packed
    rng: dict[str, str]  # state.capture_rng()
    extras: dict[str, str]  # param groups, extra state: the opt header's strings
    common: dict  # the iteration's common fields, as a save reports them

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for packed in (self.model, self.optim) for _, _, data in packed.values())


class Ledger(Protocol):
    """What a keeper tells the job's controller (`controller.snapshots.SnapshotLedger`, a part of it)."""

    def replicated(self, step: int, rank: int, node: str) -> None: ...


def running_ray():
    """Ray, where this process runs in one (the checkpoint core itself imports no Ray: scripts/gpu_check.py)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def node_id() -> str:
    """This process's Ray node ("local" outside Ray: the in-process harness has one keeper)."""
    ray = running_ray()
    return ray.get_runtime_context().get_node_id() if ray else "local"


class MemoryKeeper:
    """Snapshots of the ranks of one node, in Ray's object store, owned by this actor; and a
    replica of those of the node before it (its `peer` holds this one's), for a node loss."""

    def __init__(self, attaching: bool = False):
        self.held: dict[tuple[int, int], list] = {}  # (step, rank) -> [its ObjectRef] (or the snapshot, outside Ray)
        self.controller = self.peer = None
        # The driver attaches its keepers without waiting for their processes to start (they start beside
        # the first group); a snapshot that comes first, from a rank, waits for the attachment.
        self.attached = threading.Event()
        if not attaching:
            self.attached.set()

    def attach(self, controller, peer) -> None:
        """The job's controller, told of each replica, and the keeper that replicates this one's."""
        self.controller, self.peer = controller, peer
        self.attached.set()

    def keep_snapshot(self, step: int, rank: int, snapshot: Snapshot, replica: bool = False) -> None:
        self.attached.wait(ATTACH_S)  # past it, this snapshot is kept without a replica
        # ray.put here: the sender's copy is owned by the sender and would die with it.
        ray = running_ray()
        held = self.held[(step, rank)] = [ray.put(snapshot)] if ray else [snapshot]
        if replica:
            tell(self.controller, Ledger.replicated, step, rank, node_id())
        # the ref, resolved on the peer's node: the object travels there, off every rank's path
        elif self.peer is not None:
            self.peer.keep_snapshot.remote(step, rank, held[0], True)

    def snapshot(self, step: int, rank: int) -> list | None:
        """[the ObjectRef] (in a list, so Ray hands the reference over, not a copy), or None."""
        return self.held.get((step, rank))

    def drop_before(self, step: int, keep: int | None = None) -> None:
        """`step` is complete for every rank: older snapshots but `keep` will never be resumed."""
        for key in [k for k in self.held if k[0] < step and k[0] != keep]:
            del self.held[key]

    def held_steps(self) -> list[tuple[int, int]]:
        return sorted(self.held)
