"""What every rank of a group must agree on, in one place: each a single collective.

A rank that decides alone (to fall back, to stop, to restore from memory)
while its peers decide otherwise leaves them waiting in a collective that
never comes; every such decision goes through one of these, and a failure
on the deciding rank reaches every rank as an error.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from .errors import CheckpointError


def collective_device() -> torch.device:
    """Where tensors for the process group's collectives must live (the GPU under NCCL)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _grouped() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def decided_by_rank0(decide, rank: int, what: str):
    """`decide()` (a JSON value) computed by rank 0 alone and broadcast to every rank.

    What rank 0 raises is raised on every rank, with rank 0's message, so no
    rank waits for a broadcast that never comes: a CheckpointError as one, anything
    else (a controller gone, a storage error) as a RuntimeError naming what failed.
    """
    if not _grouped():
        return decide()
    message, failure = b"", None
    if rank == 0:
        try:
            message = json.dumps({"value": decide()}).encode()
        except Exception as exc:  # the other ranks wait for this broadcast: tell them, then raise here
            failure = exc
            text = str(exc) if isinstance(exc, CheckpointError) else f"rank 0 could not {what}: {exc!r}"
            message = json.dumps({"error": text, "checkpoint": isinstance(exc, CheckpointError)}).encode()
    got = json.loads(broadcast_bytes(message))
    if failure is not None:
        raise failure
    if "error" in got:
        raise (CheckpointError if got["checkpoint"] else RuntimeError)(got["error"])
    return got["value"]


def broadcast_bytes(data: bytes) -> bytes:
    """Rank 0's `data` on every rank (the others pass b"")."""
    if not _grouped():
        return data
    device = collective_device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    buf = buf.to(device)
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes()


def largest(values: list[int]) -> list[int]:
    """Each integer's largest value over the ranks."""
    return _reduced(values, dist.ReduceOp.MAX)


def smallest(values: list[int]) -> list[int]:
    """Each integer's smallest value over the ranks."""
    return _reduced(values, dist.ReduceOp.MIN)


def _reduced(values: list[int], op) -> list[int]:
    if not _grouped():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=op)
    return t.tolist()
