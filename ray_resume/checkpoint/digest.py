"""sha256 per checksum block, computed beside the I/O that moves the same bytes, not after it.

A shard file is checked in blocks (`block_bounds`): its header, then each
`block_size` bytes of its data section. A reader can then verify any block
it reads on its own, so load_balanced deals blocks, not whole files, and
the busiest rank reads one block more than the mean at most.

Hashing costs about 0.55 s/GB on one core here, as much as writing to the
page cache. hashlib releases the GIL while it hashes a large buffer, so one
helper thread hashes piece i while the caller writes (or reads) piece i+1:
a save or a verified load then costs max(I/O, hash), not their sum.
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor


def block_bounds(size: int, data_start: int, block_size: int) -> list[tuple[int, int]]:
    """The checksum blocks of a `size`-byte shard file: [0, data_start), then `block_size` bytes at a time."""
    return [(0, data_start)] + [(lo, min(lo + block_size, size)) for lo in range(data_start, size, block_size)]


@functools.cache
def _hasher() -> ThreadPoolExecutor:
    # One worker: updates run in submission order, which a running hash needs.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")


# A forked child has no copy of the hashing thread; it starts its own.
os.register_at_fork(after_in_child=_hasher.cache_clear)


class BlockSha256:
    """The sha256 of each block of a run of consecutive blocks, fed as one byte stream.

    `ends` are the blocks' end offsets and `start` the first block's start;
    `update` cuts the stream at block ends and returns at once; `hexdigests`
    waits for the queued hashing. A buffer given to `update` must keep its
    bytes until the returned future is done (or `hexdigests` returns): a
    reused scratch buffer waits for it first.
    """

    def __init__(self, start: int, ends: list[int]):
        self._ends = ends
        self._digests = [hashlib.sha256() for _ in ends]
        self._pos, self._block = start, 0
        self._queued: list[Future] = []

    def update(self, data) -> Future | None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self._block == len(self._ends):
                raise ValueError(f"{view.nbytes} bytes past the last checksum block (which ends at {self._ends[-1]})")
            take = view[: self._ends[self._block] - self._pos]
            self._queued.append(_hasher().submit(self._digests[self._block].update, take))
            self._pos += take.nbytes
            view = view[take.nbytes :]
            if self._pos == self._ends[self._block]:
                self._block += 1
        return self._queued[-1] if self._queued else None

    def hexdigests(self) -> list[str]:
        for future in self._queued:
            future.result()  # an update's error surfaces here
        self._queued.clear()
        if self._block != len(self._ends):
            raise ValueError(f"the stream ended at byte {self._pos}, inside the checksum block that ends at {self._ends[self._block]}")
        return [d.hexdigest() for d in self._digests]
