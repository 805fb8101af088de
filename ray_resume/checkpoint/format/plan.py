"""Who writes which rows of each tensor. Pure planning, no I/O (the torch DCP planner split).

A tensor is stored in chunks, each a range of its dim-0 rows `[first, first + rows)` held by one
rank's shard file: an N-dimensional box (MindFormers' `global_offset` / `local_shape`), and a flat
element range `[first * row_numel, (first + rows) * row_numel)` of the row-major tensor (a
`Piece`). A 0-d tensor is one chunk of its one element.

`SavePlan(specs, W)` decides the chunks of every tensor of every kind for W saving ranks:

- sharded state (FSDP2 `fully_shard`: parameters and their optimizer slots) is stored as the
  ranks hold it: rank r the rows `torch.chunk(t, W, dim=0)[r]`;
- replicated state (DDP; FSDP's 0-d steps) is stored once. A tensor larger than a part (1/(4W)
  of all replicated bytes, at least 64 KiB) is cut in k equal row ranges, k the fewest that
  divide its rows and keep each within a part (at most W); then every part, whole tensors
  included, goes to the rank that holds the fewest replicated bytes, largest first, the k parts
  of a tensor to k different ranks. Each rank writes about 1/W of the bytes, and MindFormers'
  `Layout` (a dimension cut in equal parts over a list of ranks) describes every cut.

Every rank computes the same plan from the same specs. The commit records the chunks in
metadata.json, so a reader never plans: it reads where each chunk is (`schema.Stored`).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

MIN_PART = 64 << 10  # bytes: a replicated tensor smaller than this is never cut
PARTS_PER_RANK = 4  # parts of at most 1/(4W) of the bytes: a rank's load is within ~1/4 of a part of the mean


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor: name, safetensors dtype tag, shape, element size; `sharded` when every rank
    holds only its `torch.chunk` rows of it (FSDP2)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    sharded: bool = False

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
    def rows(self) -> int:
        """Dim-0 rows (a 0-d tensor is one row of one element)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (1 for a 0-d or 1-d tensor)."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n


@dataclass(frozen=True)
class Piece:
    """Elements `[start, start + numel)` of tensor `name`, flattened row-major: a chunk of its rows."""

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


def rows_piece(spec: TensorSpec, first: int, rows: int) -> Piece:
    return Piece(spec.name, first * spec.row_numel, rows * spec.row_numel)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def equal_parts(spec: TensorSpec, part_bytes: int, world_size: int) -> int:
    """In how many equal dim-0 parts a replicated tensor is stored: the fewest that divide its rows and
    keep each part within `part_bytes`, at most `world_size` (else the most that divide it)."""
    if not spec.shape or spec.nbytes <= part_bytes or spec.rows < 2:
        return 1
    need = -(-spec.nbytes // part_bytes)
    divisors = [d for d in _divisors(spec.rows) if d <= world_size]
    fit = [d for d in divisors if d >= need]
    return min(fit) if fit else max(divisors)


class SavePlan:
    """Every tensor's chunks at one world size: `share(kind, rank)` is what a rank writes, `chunks(kind,
    name)` [(rank, piece)] in row order. Placing the replicated parts costs O((tensors + parts) log W),
    the same on every rank; a sharded tensor's chunks follow from torch.chunk, computed when asked."""

    def __init__(self, specs: dict[str, list[TensorSpec]], world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.specs = {kind: {s.name: s for s in ss} for kind, ss in specs.items()}
        self._placed: dict[str, dict[str, list[tuple[int, Piece]]]] = {kind: {} for kind in specs}
        replicated = [(kind, s) for kind, ss in specs.items() for s in ss if not (s.sharded and s.shape)]
        part = max(-(-sum(s.nbytes for _, s in replicated) // (PARTS_PER_RANK * world_size)), MIN_PART)
        least = [(0, r) for r in range(world_size)]
        for kind, spec in sorted(replicated, key=lambda ks: (-ks[1].nbytes, ks[0], ks[1].name)):
            k = equal_parts(spec, part, world_size)
            taken = [heapq.heappop(least) for _ in range(k)]
            rows = spec.rows // k
            for i, (_, rank) in enumerate(sorted(taken, key=lambda lr: lr[1])):
                piece = rows_piece(spec, i * rows, rows) if spec.shape else Piece(spec.name, 0, spec.numel)
                self._placed[kind].setdefault(spec.name, []).append((rank, piece))
            for held, rank in taken:
                heapq.heappush(least, (held + spec.nbytes // k, rank))
        self._replicated_shares: dict[tuple[str, int], list[Piece]] = {}
        for kind, placed in self._placed.items():
            for name in self.specs[kind]:  # tensor order
                for rank, piece in placed.get(name, []):
                    self._replicated_shares.setdefault((kind, rank), []).append(piece)

    def chunks(self, kind: str, name: str) -> list[tuple[int, Piece]]:
        """(rank, piece) of every chunk of a tensor, in row order."""
        spec = self.specs[kind][name]
        if name in self._placed[kind]:
            return self._placed[kind][name]
        pieces = [(r, dim0_piece(spec, self.world_size, r)) for r in range(self.world_size)]
        return [(r, p) for r, p in pieces if p.numel] or pieces[:1]  # an empty tensor: one empty chunk, on rank 0

    def share(self, kind: str, rank: int) -> list[Piece]:
        """The pieces `rank` writes of `kind`: its replicated parts, then its rows of each sharded tensor."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        own = [
            dim0_piece(s, self.world_size, rank)
            for name, s in self.specs[kind].items()
            if name not in self._placed[kind]
        ]
        return self._replicated_shares.get((kind, rank), []) + [
            p for p in own if p.numel or (rank == 0 and not p.numel and not self.specs[kind][p.name].numel)
        ]


def overlaps(pieces: list[tuple[str, Piece]], start: int, numel: int) -> list[tuple[str, Piece]]:
    """(file, piece) for every stored piece (sorted by start, tiling the tensor) that overlaps elements
    [start, start + numel)."""
    if numel <= 0:
        return []
    starts = [p.start for _, p in pieces]
    first = max(bisect.bisect_right(starts, start) - 1, 0)
    out = []
    for file, piece in pieces[first:]:
        if piece.start >= start + numel:
            break
        if piece.start + piece.numel > start:
            out.append((file, piece))
    return out


def needed_range(spec: TensorSpec, sharded: bool, world_size: int, rank: int) -> tuple[int, int]:
    """(start, numel) of `spec` that `rank` of a `world_size` group loads: all of it, or its dim-0 chunk."""
    if not sharded:
        return 0, spec.numel
    piece = dim0_piece(spec, world_size, rank)
    return piece.start, piece.numel


def format4_pieces(
    specs: list[TensorSpec], layouts: dict[str, str], world_size: int
) -> dict[str, list[tuple[int, Piece]]]:
    """Where format 4 put every piece (read-only: roots written before format 5). `dim0` tensors as
    FSDP2 shards them; `split` ones, sorted by name, laid end to end as one byte stream cut in
    `world_size` equal byte ranges, each element with the rank whose range holds its first byte."""
    out: dict[str, list[tuple[int, Piece]]] = {}
    split = sorted((s for s in specs if layouts[s.name] == "split"), key=lambda s: s.name)
    total = sum(s.nbytes for s in split)
    bounds = [r * total // world_size for r in range(world_size)] + [total]
    offset = 0
    for spec in split:
        element = 0
        while element < spec.numel:
            rank = min(world_size - 1, bisect.bisect_right(bounds, offset + element * spec.itemsize) - 1)
            end_byte = bounds[rank + 1] - offset
            end = (
                spec.numel
                if rank == world_size - 1
                else min(spec.numel, max(element + 1, -(-end_byte // spec.itemsize)))
            )
            out.setdefault(spec.name, []).append((rank, Piece(spec.name, element, end - element)))
            element = end
        offset += spec.nbytes
    for spec in specs:
        if layouts[spec.name] == "dim0":
            out[spec.name] = [(r, p) for r in range(world_size) for p in [dim0_piece(spec, world_size, r)] if p.numel]
    return out
