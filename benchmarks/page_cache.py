"""Cold reads for the benchmarks: evict a tree's pages so that the next read goes to storage (no root needed)."""

from __future__ import annotations

import os


def drop_cache(path: str) -> None:
    """Write back and evict the clean pages of every file under `path`."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
