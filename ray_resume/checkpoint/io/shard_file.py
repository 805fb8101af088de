"""One shard file written from its header and data section: streamed, hashed, fsynced, retried.

Shared by the rank's own writes (sync saves, the writer thread) and the writer
process (`writer_process`), which must not import torch: nothing here does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..format.digest import BlockDigests
from .storage import retried

# Bytes handed to one write(): each piece is hashed while still in the CPU cache and
# the kernel writes back earlier pieces meanwhile. Measured on this kind of host:
# 1 MiB pieces save 328 MB in 0.35 s, single 164 MB writes take ~1.05 s.
WRITE_PIECE = 1 << 20
# A snapshot's file is hashed as it was copied (`writer.SnapshotBuffers.take`): nothing to hash
# here, and fewer, larger writes cost less CPU past the page cache (benchmarks/README.md: 0.016 s of
# CPU against 0.037 s for 328 MB in 16 MiB writes rather than 1 MiB ones).
HASHED_WRITE_PIECE = 16 << 20


@dataclass(frozen=True)
class ShardFile:
    """One shard file of a save: where it goes, its safetensors header, and where its checksum blocks end."""

    path: str
    kind: str  # paths.MODEL_KIND or paths.OPTIM_KIND: whose data section follows the header
    head: bytes
    ends: list[int]
    # The digest of each checksum block where its bytes were hashed as they were copied (an async
    # save's snapshot, which no one changes before it is written); None: hashed as they are written.
    digests: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def write_file(
    storage, file: ShardFile, data: list[memoryview], checksum: str, on_mid_write: Callable[[], None] | None = None
) -> tuple[int, list[str]]:
    """Write `file`'s header then `data` durably; return its size and the digests of its checksum blocks.

    A transient error rewrites the whole file, hashed afresh (unless it came hashed:
    `file.digests`). `on_mid_write`, where given (an injected fault, faults.py), is
    called once half of the bytes are written.
    """
    piece = WRITE_PIECE if file.digests is None else HASHED_WRITE_PIECE
    chunks = [memoryview(file.head), *_pieces(data, at=len(file.head), size=piece)]

    def write():
        digest = BlockDigests(checksum, 0, file.ends) if file.digests is None else _Hashed(file.digests, file.ends)
        pieces = chunks if on_mid_write is None else _halves(chunks, on_mid_write)
        return storage.write_durable(file.path, pieces, digest), digest

    size, digest = retried(write, f"write of {file.path}")
    return size, digest.hexdigests()


class _Hashed:
    """A file's digests known already: `write_durable` feeds it the bytes, and it only counts them, so
    that a stream of another length than the blocks' fails here, as `BlockDigests` would, not at load."""

    def __init__(self, digests: tuple[str, ...], ends: list[int]):
        if len(digests) != len(ends):
            raise ValueError(f"{len(digests)} digests for {len(ends)} checksum blocks")
        self._digests, self._size, self._fed = list(digests), ends[-1], 0

    def update(self, data) -> None:
        self._fed += memoryview(data).nbytes

    def hexdigests(self) -> list[str]:
        if self._fed != self._size:
            raise ValueError(f"the stream ended at byte {self._fed}, its checksum blocks at {self._size}")
        return self._digests


def _pieces(views: list[memoryview], at: int, size: int) -> Iterator[memoryview]:
    """Zero-copy slices of at most `size` bytes, in order, cut where the file's offset (`at` for the
    first byte) is a multiple of `size`: past the page cache, each then goes to the disk whole
    (direct_io), not a block of it through the bounce buffer."""
    for view in views:
        start = 0
        while start < view.nbytes:
            end = min(view.nbytes, start + size - (at + start) % size)
            yield view[start:end]
            start = end
        at += view.nbytes


def _halves(chunks: list[memoryview], between: Callable[[], None]) -> Iterator[memoryview]:
    """The file's bytes, with a hook called once half of them are written (fault injection)."""
    half = sum(c.nbytes for c in chunks) // 2
    written, fired = 0, False
    for chunk in chunks:
        if not fired and written + chunk.nbytes >= half:
            cut = half - written
            if cut:
                yield chunk[:cut]
            between()
            fired, chunk, written = True, chunk[cut:], half
        if chunk.nbytes:
            yield chunk
        written += chunk.nbytes
