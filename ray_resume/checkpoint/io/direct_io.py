"""A shard file written past the page cache (O_DIRECT), straight from the memory that holds its bytes.

Through the page cache, every byte of a save is copied once more by the CPU into the cache, written
back later by the kernel's flusher, and holds memory meanwhile: on two busy cores that work is taken
from training, whoever does it (benchmarks/README.md, "Training throughput while saving").
O_DIRECT hands the disk the writer's own pages instead.

Every O_DIRECT write needs its memory, file offset and length aligned to the device's block: ALIGN
(4096) is a multiple of every logical block size in use. A piece whose memory is aligned as its place
in the file is (an async save's snapshot buffer: `writer.SnapshotBuffers` puts each data section at
the file's alignment) goes to the disk as it is; the rest (the header, a file's last block, a live
tensor's bytes in a sync save) through a small aligned bounce buffer. Where the file system takes no
O_DIRECT (ramfs refuses it at open, as tmpfs did before Linux 6.6; some refuse a write), the caller
writes through the page cache: the bytes on disk are the same either way.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Iterable

import numpy

logger = logging.getLogger(__name__)

ALIGN = 4096
BOUNCE = 1 << 20  # the bounce buffer: the header and the pieces that are not aligned pass through it


def write(path: str, chunks: Iterable[memoryview], digest) -> int | None:
    """Write `chunks` into a new `path` with O_DIRECT and fsync it; `digest` hashes each chunk just
    before its write. The size written, or None where the file system refuses O_DIRECT at open (then
    nothing is written)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    try:
        size = _Writer(fd, path).write_all(chunks, digest)
        os.fsync(fd)  # its size too; and the soak's power cut knows a file as durable by its fsync
    finally:
        os.close(fd)
    return size


_BUFFERED_DEVICES: set[int] = set()  # the file systems this process found refusing O_DIRECT


def say_buffered(path: str) -> None:
    """Once per file system and process: its shard files go through the page cache."""
    device = os.stat(path).st_dev
    if device not in _BUFFERED_DEVICES:
        _BUFFERED_DEVICES.add(device)
        logger.info("%s takes no O_DIRECT: shard files are written through the page cache there", path)


def aligned_start(buffer_address: int, file_offset: int) -> int:
    """Where in a buffer at `buffer_address` to put the byte that goes to `file_offset`, so that its
    memory is aligned as its place in the file: between 0 and ALIGN - 1."""
    return (file_offset - buffer_address) % ALIGN


def address(view: memoryview) -> int:
    """Where `view`'s first byte lies in memory (a read-only view too: the writer process maps its
    buffers read-only)."""
    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data if view.nbytes else 0


class _Writer:
    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self.bounce = mmap.mmap(-1, BOUNCE)  # anonymous, so page-aligned
        self.pending = 0  # bytes waiting in the bounce buffer, for file offset self.done
        self.done = 0  # bytes written to the file
        self.bounced = 0  # of them, bytes copied through the bounce buffer (the rest went from their own pages)

    def write_all(self, chunks: Iterable[memoryview], digest) -> int:
        try:
            for chunk in chunks:
                digest.update(chunk)
                self._take(memoryview(chunk).cast("B"))
                self._flush()  # what a chunk completes is on its way: a crash after it finds it written
            size = self.done + self.pending
            if self.pending:  # the last block, padded with zeros to ALIGN, then cut back to the file's size
                padded = -(-self.pending // ALIGN) * ALIGN
                self.bounce[self.pending : padded] = bytes(padded - self.pending)
                self._write(memoryview(self.bounce)[:padded])
                os.ftruncate(self.fd, size)
            return size
        finally:
            try:
                self.bounce.close()
            except BufferError:  # a failed write's traceback still holds a view of it: it goes with the error
                pass

    def _take(self, view: memoryview) -> None:
        while view.nbytes:
            at = self.done + self.pending  # the file offset of view[0]
            if address(view) % ALIGN == at % ALIGN:  # aligned as its place in the file
                head = min(-at % ALIGN, view.nbytes)  # up to an aligned offset through the bounce buffer
                if self.pending + head > BOUNCE:
                    self._flush()
                self._fill(view[:head])
                view = view[head:]
                whole = view.nbytes - view.nbytes % ALIGN
                if whole:  # `done + pending` is aligned now: the bounce buffer empties whole
                    self._flush()
                    self._write(view[:whole])  # the rest as it is, from its own pages
                    self.done += whole
                    view = view[whole:]
                    continue
            taken = min(view.nbytes, BOUNCE - self.pending)
            self._fill(view[:taken])
            view = view[taken:]
            if self.pending == BOUNCE:
                self._flush()

    def _fill(self, view: memoryview) -> None:
        self.bounce[self.pending : self.pending + view.nbytes] = view
        self.pending += view.nbytes
        self.bounced += view.nbytes

    def _flush(self) -> None:
        """Write the bounce buffer's whole blocks; a partial block's bytes stay for the next."""
        whole = self.pending - self.pending % ALIGN
        if not whole:
            return
        self._write(memoryview(self.bounce)[:whole])
        self.done += whole
        rest = self.pending - whole
        self.bounce[:rest] = self.bounce[whole : self.pending]
        self.pending = rest

    def _write(self, view: memoryview) -> None:
        while view.nbytes:
            try:
                n = os.write(self.fd, view)
            except OSError as exc:
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                if exc.errno != errno.EINVAL or not flags & os.O_DIRECT:
                    raise
                # opened with O_DIRECT but this write refused: the rest of the file through the page cache
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                say_buffered(os.path.dirname(self.path) or ".")
                continue
            view = view[n:]
