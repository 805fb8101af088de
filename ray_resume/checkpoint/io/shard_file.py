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


@dataclass(frozen=True)
class ShardFile:
    """One shard file of a save: where it goes, its safetensors header, and where its checksum blocks end."""

    path: str
    kind: str  # paths.MODEL_KIND or paths.OPTIM_KIND: whose data section follows the header
    head: bytes
    ends: list[int]

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def write_file(
    storage, file: ShardFile, data: list[memoryview], checksum: str, on_mid_write: Callable[[], None] | None = None
) -> tuple[int, list[str]]:
    """Write `file`'s header then `data` durably; return its size and the digests of its checksum blocks.

    A transient error rewrites the whole file, hashed afresh. `on_mid_write`, where
    given (an injected fault, faults.py), is called once half of the bytes are written.
    """
    chunks = [memoryview(file.head), *_pieces(data, at=len(file.head))]

    def write():
        digest = BlockDigests(checksum, 0, file.ends)
        pieces = chunks if on_mid_write is None else _halves(chunks, on_mid_write)
        return storage.write_durable(file.path, pieces, digest), digest

    size, digest = retried(write, f"write of {file.path}")
    return size, digest.hexdigests()


def _pieces(views: list[memoryview], at: int, size: int = WRITE_PIECE) -> Iterator[memoryview]:
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
