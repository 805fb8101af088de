"""The memory tier: each rank's state every `checkpoint.memory_interleaved_steps`, held where a
worker's death does not take it.

A snapshot is one rank's whole state at a step, as it stands in that rank (its FSDP shards, its
own buffers): model and optimizer tensors as raw bytes, the RNG streams and extras as text, and
the iteration's common fields (step, data cursor, loss scale). It goes to the `MemoryKeeper` of
the rank's node, an actor the driver starts on every node of the cluster, which puts it in Ray's
object store under its own ownership: the object outlives the worker that sent it, and the
worker-group restart, as the job's controller does. With more than one node, each keeper
replicates what it holds to the next node's keeper, for a node lost with its keeper.

A restarted group of the same world size resumes from the newest step whose snapshots are in for
every rank, if that is newer than the newest durable commit (the controller decides, see
`JobController.memory_step`); each rank takes back exactly what it held, so the run continues
as if nothing happened. Only durable commits are committed: the tracker and the files on disk
know nothing of this tier. Once a step is complete everywhere, every older snapshot is dropped
but the newest one whose replicas are all in: a keeper holds at most three per rank of its node
(that one, the newest complete step, the one being sent) and as many replicas.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .state import local_tensor

MEMORY_SOURCE = "memory snapshot of step {step}"  # what a resume from it names as its source


def is_memory_source(source: str | None) -> bool:
    return bool(source) and source.startswith(MEMORY_SOURCE.split("{")[0])


def _ray():
    """Ray, where this process runs in one (the checkpoint core itself imports no Ray: scripts/gpu_check.py)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def node_id() -> str:
    """This process's Ray node ("local" outside Ray: the in-process harness has one keeper)."""
    ray = _ray()
    return ray.get_runtime_context().get_node_id() if ray else "local"


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """Copies of this rank's tensors (its own part of a DTensor) as (dtype, shape, bytes): numpy
    arrays travel through Ray's object store without a copy, and bfloat16 has no numpy dtype."""
    out = {}
    for name, t in tensors.items():
        local = local_tensor(t).detach()
        copy = local.to("cpu", copy=True).contiguous()
        out[name] = (
            str(copy.dtype).removeprefix("torch."),
            list(copy.shape),
            copy.reshape(-1).view(torch.uint8).numpy(),
        )
    return out


FETCH_TIMEOUT_S = 60.0  # a keeper on a node that is going: Ray declares it dead within its health checks


def fetch(keeper, step: int, rank: int) -> dict | None:
    """`rank`'s snapshot of `step` from `keeper`, or None if it has none; raises if the keeper is gone."""
    ray = _ray()
    if ray is None or not isinstance(keeper, ray.actor.ActorHandle):
        held = keeper.snapshot(step, rank)
        return None if held is None else held[0]
    held = ray.get(keeper.snapshot.remote(step, rank), timeout=FETCH_TIMEOUT_S)
    return None if held is None else ray.get(held[0], timeout=FETCH_TIMEOUT_S)


def unpack(packed: dict[str, tuple[str, list[int], np.ndarray]]) -> dict[str, torch.Tensor]:
    """The tensors `pack` copied (the object store's arrays are read-only: copied once more)."""
    return {
        name: torch.from_numpy(np.array(data)).view(getattr(torch, dtype)).reshape(shape)
        for name, (dtype, shape, data) in packed.items()
    }


class MemoryKeeper:
    """Snapshots of the ranks of one node, in Ray's object store, owned by this actor; and a
    replica of those of the node before it (its `peer` holds this one's), for a node loss."""

    def __init__(self):
        self.held: dict[tuple[int, int], list] = {}  # (step, rank) -> [its ObjectRef] (or the snapshot, outside Ray)
        self.controller = self.peer = None

    def attach(self, controller, peer) -> None:
        """The job's controller, told of each replica, and the keeper that replicates this one's."""
        self.controller, self.peer = controller, peer

    def keep_snapshot(self, step: int, rank: int, snapshot: dict, replica: bool = False) -> None:
        # ray.put here: the sender's copy is owned by the sender and would die with it.
        ray = _ray()
        held = self.held[(step, rank)] = [ray.put(snapshot)] if ray else [snapshot]
        if replica:
            from ..calls import tell

            tell(self.controller, "replicated", step, rank, node_id())
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
