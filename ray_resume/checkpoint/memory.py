"""The memory tier: each rank's state every `checkpoint.memory_interleaved_steps`, held where a
worker's death does not take it.

A snapshot is one rank's whole state at a step, as it stands in that rank (its FSDP shards, its
own buffers): model and optimizer tensors as raw bytes, the RNG streams and extras as text, and
the iteration's common fields (step, data cursor, loss scale). It goes to the `MemoryKeeper` (checkpoint.keeper) of
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

import math

import numpy as np
import torch

from .keeper import Snapshot, node_id, running_ray
from .format.state import local_tensor

MEMORY_SOURCE = "memory snapshot of step {step}"  # what a resume from it names as its source
# `memory_interleaved_steps: auto`, decided by each group at its AUTO_AFTER-th step (its first steps run
# slower than the rest, beside Ray Train's new actors): the interval whose snapshots take at most
# AUTO_BUDGET of the training time, from one snapshot timed then and the steps before it (CheckFreq's
# way: an overhead bound, the interval measured), unless a keeper could not hold them.
AUTO_AFTER = 8
AUTO_BUDGET = 0.05
HELD = 6  # snapshots a keeper holds per rank of its node at most: three, and as many replicas of another's


def is_memory_source(source: str | None) -> bool:
    return bool(source) and source.startswith(MEMORY_SOURCE.split("{")[0])


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


def auto_interval(
    snapshot_s: float, step_s: float, share_bytes: int, ranks_on_node: int, store_bytes: int | None, save_every: int
) -> tuple[int, str]:
    """`memory_interleaved_steps: auto`: the interval (0: off) and, in words, why. `snapshot_s`: one
    snapshot, its copy and its send; `store_bytes`: the node's object store (None: not in Ray)."""
    held = HELD * share_bytes * ranks_on_node
    if store_bytes is not None and held > store_bytes / 2:
        return 0, (
            f"off: its snapshots would take {held / 2**30:.1f} GiB of this node's object store, more than half of "
            f"its {store_bytes / 2**30:.1f} GiB; restarts resume from durable saves"
        )
    every = max(1, math.ceil(snapshot_s / (AUTO_BUDGET * step_s)))
    measured = f"one took {snapshot_s:.3f} s, a step {step_s:.3f} s"
    if every >= save_every:
        return 0, f"off: a snapshot every {every} steps ({measured}) is no more often than the durable saves"
    return every, f"a snapshot every {every} steps ({measured}: at most {AUTO_BUDGET:.0%} of the time)"


def object_store_bytes() -> int | None:
    """This node's object store, where its keeper holds the snapshots (None outside Ray)."""
    ray = running_ray()
    if ray is None:
        return None
    here = node_id()
    return next((int(n["Resources"].get("object_store_memory", 0)) for n in ray.nodes() if n["NodeID"] == here), None)


def ranks_on_node(world: int) -> int:
    """How many of the group's ranks share this node (all of them outside Ray Train)."""
    if running_ray() is None:
        return world
    import ray.train

    return ray.train.get_context().get_local_world_size()


def fetch(keeper, step: int, rank: int) -> Snapshot | None:
    """`rank`'s snapshot of `step` from `keeper`, or None if it has none; raises if the keeper is gone."""
    ray = running_ray()
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
