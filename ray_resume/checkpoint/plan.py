"""Who writes which bytes. Pure planning, no I/O (the torch DCP planner split).

Replicated (DDP) state is the same on every rank, so writing it from every
rank would store it W times. Instead the tensors of one kind (model or
optimizer) are laid end to end as one byte stream, the stream is cut into W
equal byte ranges, and rank r writes the elements that start in range r.
Every tensor piece is a flat element range `[start, start + numel)` of the
row-major tensor; that one shape of piece also describes dim-0 shards, so a
reader can reshard from `metadata.json` alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor: name, safetensors dtype tag, shape, element size."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements `[start, start + numel)` of tensor `name`, flattened row-major."""

    name: str
    start: int
    numel: int


def split_replicated(specs: list[TensorSpec], world_size: int) -> list[list[Piece]]:
    """Cut the byte stream of `specs` into `world_size` balanced shares.

    Runs in O(tensors + world_size): one pass over tensors, each rank boundary
    visited once. Rank r owns stream bytes [r*T//W, (r+1)*T//W); an element
    belongs to the rank whose range holds its first byte, so no element is
    split and every element has exactly one owner.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(s.nbytes for s in specs)
    bounds = [r * total // world_size for r in range(world_size + 1)]
    shares: list[list[Piece]] = [[] for _ in range(world_size)]
    rank = 0
    offset = 0  # byte offset of the current tensor in the stream
    for spec in specs:
        n, size = spec.numel, spec.itemsize
        element = 0
        while element < n:
            while bounds[rank + 1] <= offset + element * size and rank < world_size - 1:
                rank += 1
            # First element whose first byte lies at or past the next boundary.
            end_byte = bounds[rank + 1] - offset
            end = n if rank == world_size - 1 else min(n, max(element + 1, -(-end_byte // size)))
            shares[rank].append(Piece(spec.name, element, end - element))
            element = end
        offset += spec.nbytes
    return shares
