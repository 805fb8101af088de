"""A digest per checksum block, computed beside the I/O that moves the same bytes, not after it.

A shard file is checked in blocks (`block_bounds`): its header, then each
`block_size` bytes of its data section. A reader can then verify any block
it reads on its own, so load_balanced deals blocks, not whole files, and
the busiest rank reads one block more than the mean at most.

The algorithm is named per file in metadata.json (`checksum`), so it can
change again. Measured on one core here (`python -m benchmarks.checksums`):
xxh3-128 hashes ~30 GB/s, CRC32C ~15 GB/s, BLAKE3 ~8 GB/s, sha256 ~2 GB/s.
xxh3-128 is the default: 128 bits (a random corruption slips through with
probability 2**-128, against 2**-32 for a CRC), and fast enough that it
runs inline, on the thread doing the I/O (handing a 1 MiB piece to a
thread costs more than hashing it). sha256 remains for those who want a
cryptographic digest; it is slower than the page cache takes writes, so its
blocks are dealt over helper threads (blocks are independent), up to one
per core, and a save or a verified load costs max(I/O, hash / threads).
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

DEFAULT_CHECKSUM = "xxh3-128"
# name: (hash constructor, hex digits, hashed on helper threads)
CHECKSUMS = {
    "xxh3-128": (xxhash.xxh3_128, 32, False),
    "sha256": (hashlib.sha256, 64, True),
}
MAX_HASH_THREADS = 4


def inline(checksum: str) -> bool:
    """Whether `checksum` is hashed on the thread that feeds it (xxh3-128), not on helper threads (sha256)."""
    return not CHECKSUMS[checksum][2]


def block_bounds(size: int, data_start: int, block_size: int) -> list[tuple[int, int]]:
    """The checksum blocks of a `size`-byte shard file: [0, data_start), then `block_size` bytes at a time."""
    return [(0, data_start)] + [(lo, min(lo + block_size, size)) for lo in range(data_start, size, block_size)]


def hexdigest(checksum: str, data) -> str:
    """The `checksum` digest of `data`, as metadata.json lists it."""
    return CHECKSUMS[checksum][0](data).hexdigest()


@functools.cache
def _hashers() -> tuple[ThreadPoolExecutor, ...]:
    # One worker each: a block always goes to the same one, so its updates run in order.
    return tuple(
        ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hash{i}")
        for i in range(max(1, min(MAX_HASH_THREADS, os.cpu_count() or 1)))
    )


# A forked child has no copy of the hashing threads; it starts its own.
os.register_at_fork(after_in_child=_hashers.cache_clear)


class BlockDigests:
    """The `checksum` digest of each block of a run of consecutive blocks, fed as one byte stream.

    `ends` are the blocks' end offsets and `start` the first block's start;
    `update` cuts the stream at block ends. For a threaded algorithm it
    returns at once with the futures hashing the bytes given, and a buffer
    must keep its bytes until they are done (or `hexdigests` returns): a
    reused scratch buffer waits for them first. Inline, the bytes are hashed
    when it returns (no futures).
    """

    def __init__(self, checksum: str, start: int, ends: list[int]):
        make, _, threaded = CHECKSUMS[checksum]
        self._ends = ends
        self._digests = [make() for _ in ends]
        self._pos, self._block = start, 0
        self._hashers = _hashers() if threaded else None
        self._queued: list[Future] = []

    def update(self, data) -> list[Future]:
        view = memoryview(data).cast("B")
        queued = len(self._queued)
        while view.nbytes:
            if self._block == len(self._ends):
                raise ValueError(f"{view.nbytes} bytes past the last checksum block (which ends at {self._ends[-1]})")
            take = view[: self._ends[self._block] - self._pos]
            digest = self._digests[self._block]
            if self._hashers is None:
                digest.update(take)
            else:
                self._queued.append(self._hashers[self._block % len(self._hashers)].submit(digest.update, take))
            self._pos += take.nbytes
            view = view[take.nbytes :]
            if self._pos == self._ends[self._block]:
                self._block += 1
        return self._queued[queued:]

    def hexdigests(self) -> list[str]:
        for future in self._queued:
            future.result()  # an update's error surfaces here
        self._queued.clear()
        if self._block != len(self._ends):
            raise ValueError(
                f"the stream ended at byte {self._pos}, inside the checksum block that ends at {self._ends[self._block]}"
            )
        return [d.hexdigest() for d in self._digests]
