"""Who writes which bytes, and who reads which. Pure planning, no I/O (the torch DCP planner split).

Every tensor piece is a flat element range `[start, start + numel)` of the
row-major tensor. A tensor is stored in one of two layouts, and the layout
plus the saving world size determine every piece, so `metadata.json` names
the layout of each tensor instead of listing its pieces (O(tensors + files)
entries at any world size):

- `split`: replicated state (DDP, and small unsharded FSDP state such as
  Adam's step counter). The same on every rank, so writing it from every
  rank would store it W times. The kind's split tensors, sorted by name, are
  laid end to end as one byte stream, the stream is cut into W equal byte
  ranges, and rank r writes the elements that start in range r.
- `dim0`: FSDP2 `fully_shard` state. Rank r holds rows
  `torch.chunk(t, W, dim=0)[r]` and writes exactly those; a dim-0 row range is
  a flat element range.

A reader on W' ranks asks each tensor for the element range its rank needs
(all of it under DDP, its own dim-0 chunk under FSDP) and `overlaps` says
which saved pieces, in which rank's file, hold it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

SPLIT = "split"
DIM0 = "dim0"
LAYOUTS = (SPLIT, DIM0)


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor: name, safetensors dtype tag, shape, element size, and how it is laid out."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    layout: str = SPLIT

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (a 0-d tensor is one row of one element)."""
        return self.numel // self.shape[0] if self.shape and self.shape[0] else 1


@dataclass(frozen=True)
class Piece:
    """Elements `[start, start + numel)` of tensor `name`, flattened row-major."""

    name: str
    start: int
    numel: int


def dim0_chunk(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of `rank` in `torch.chunk(t, world_size, dim=0)`, as FSDP2 shards.

    torch.chunk gives every rank ceil(rows / W) rows until they run out, so
    trailing ranks may get fewer or none.
    """
    size = -(-rows // world_size)
    first = min(rank * size, rows)
    return first, min(size, rows - first)


def dim0_piece(spec: TensorSpec, world_size: int, rank: int) -> Piece:
    first, rows = dim0_chunk(spec.shape[0], world_size, rank)
    return Piece(spec.name, first * spec.row_numel, rows * spec.row_numel)


def split_replicated(specs: list[TensorSpec], world_size: int) -> list[list[Piece]]:
    """Cut the byte stream of `specs` (in the given order) into `world_size` balanced shares.

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


def split_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The split-layout tensors in stream order (by name, so writer and reader agree without a list)."""
    return sorted((s for s in specs if s.layout == SPLIT), key=lambda s: s.name)


class SavePlan:
    """Every rank's pieces of one kind (model or optimizer) at one world size.

    Built from the tensor specs alone, identically by the writers, the
    driver and any reader. `share(rank)` is what that rank writes;
    `overlaps(name, start, numel)` is which saved pieces hold a range.

    Building it costs O(tensors), independent of the world size: a rank's
    split share and the owners of an element range follow from the stream
    offsets by arithmetic and bisection, so no rank computes every rank's
    share (`split_replicated` does, with the same result). `share` costs
    O(log tensors + its pieces); `overlaps` O(log tensors + the pieces found).
    """

    def __init__(self, specs: list[TensorSpec], world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        for spec in specs:
            if spec.layout not in LAYOUTS:
                raise ValueError(f"tensor {spec.name!r}: unknown layout {spec.layout!r} (expected one of {LAYOUTS})")
            if spec.layout == DIM0 and not spec.shape:
                raise ValueError(f"tensor {spec.name!r}: a 0-d tensor cannot be sharded on dim 0")
        self.specs = {s.name: s for s in specs}
        self.world_size = world_size
        self._dim0 = [s for s in specs if s.layout == DIM0]
        # The split stream: its tensors, each one's first byte in it, and its length.
        self._stream = split_specs(specs)
        self._offsets: list[int] = []
        self._offset_of: dict[str, int] = {}
        total = 0
        for spec in self._stream:
            self._offsets.append(total)
            self._offset_of[spec.name] = total
            total += spec.nbytes
        self._total = total

    def _bounds(self, rank: int) -> tuple[int, int]:
        """Stream bytes [lo, hi) whose elements `rank` owns: [r*T//W, (r+1)*T//W), the last rank to the end."""
        total, world = self._total, self.world_size
        return rank * total // world, total if rank == world - 1 else (rank + 1) * total // world

    def _owner(self, byte: int) -> int:
        """The rank whose byte range holds stream byte `byte`: the largest r with r*T//W <= byte."""
        return min(self.world_size - 1, ((byte + 1) * self.world_size - 1) // self._total)

    @staticmethod
    def _elements(spec: TensorSpec, offset: int, lo: int, hi: int) -> tuple[int, int]:
        """Elements [first, end) of `spec` (at stream `offset`) whose first byte lies in [lo, hi)."""
        size, n = spec.itemsize, spec.numel
        return min(n, max(0, -(-(lo - offset) // size))), min(n, max(0, -(-(hi - offset) // size)))

    def _split_share(self, rank: int) -> list[Piece]:
        if not self._total:
            return []
        lo, hi = self._bounds(rank)
        out = []
        i = max(bisect.bisect_right(self._offsets, lo) - 1, 0)
        while i < len(self._stream) and self._offsets[i] < hi:
            spec = self._stream[i]
            first, end = self._elements(spec, self._offsets[i], lo, hi)
            if end > first:
                out.append(Piece(spec.name, first, end - first))
            i += 1
        return out

    def share(self, rank: int) -> list[Piece]:
        """The pieces `rank` writes: its split share, then its dim-0 chunks (tensor order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        own = [dim0_piece(s, self.world_size, rank) for s in self._dim0]
        return self._split_share(rank) + [p for p in own if p.numel]

    def overlaps(self, name: str, start: int, numel: int) -> list[tuple[int, Piece]]:
        """(saving rank, saved piece) for every saved piece that overlaps elements [start, start+numel)."""
        if numel <= 0:
            return []
        spec = self.specs[name]
        end = start + numel
        if spec.layout == DIM0:
            per_rank = -(-spec.shape[0] // self.world_size) * spec.row_numel
            first, last = start // per_rank, (end - 1) // per_rank
            return [(r, dim0_piece(spec, self.world_size, r)) for r in range(first, min(last, self.world_size - 1) + 1)]
        offset = self._offset_of[name]
        out = []
        for rank in range(self._owner(offset + start * spec.itemsize), self._owner(offset + (end - 1) * spec.itemsize) + 1):
            first, stop = self._elements(spec, offset, *self._bounds(rank))
            if stop > first:
                out.append((rank, Piece(name, first, stop - first)))
        return out


def needed_range(spec: TensorSpec, sharded: bool, world_size: int, rank: int) -> tuple[int, int]:
    """(start, numel) of `spec` that `rank` of a `world_size` group loads: all of it, or its dim-0 chunk."""
    if not sharded:
        return 0, spec.numel
    piece = dim0_piece(spec, world_size, rank)
    return piece.start, piece.numel
