"""The one place that touches checkpoint storage.

Every write that a reader may race with is atomic: small files go to a temp
name, are fsynced and renamed (POSIX `rename` replaces atomically), and the
directory is fsynced so the rename itself survives a power cut. Shards are
written in place and fsynced; they are only trusted after the commit has
checked their size and recorded their checksum (invariant 4).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterable


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


class LocalStorage:
    """A local or network (NFS) file system reached through POSIX calls."""

    def makedirs(self, path: str) -> None:
        os.makedirs(_local(path), exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(_local(path))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(_local(path))

    def size(self, path: str) -> int | None:
        """The file's size in bytes, or None when it does not exist."""
        try:
            return os.stat(_local(path)).st_size
        except FileNotFoundError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(_local(path)))
        except FileNotFoundError:
            return []

    def read_bytes(self, path: str) -> bytes:
        with open(_local(path), "rb") as f:
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with open(_local(path), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise OSError(errno.EIO, f"short read: wanted {length} bytes at {offset}, got {len(data)}", path)
        return data

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write `data` so that a reader sees the old file or the new one, never half."""
        local = _local(path)
        tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(os.path.dirname(local) or ".")

    def write_durable(self, path: str, chunks: Iterable[bytes]) -> tuple[int, str]:
        """Stream `chunks` into `path`, fsync, and return (size, sha256 hex)."""
        digest = hashlib.sha256()
        size = 0
        local = _local(path)
        with open(local, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(os.path.dirname(local) or ".")
        return size, digest.hexdigest()

    def sha256(self, path: str, block: int = 8 << 20) -> str:
        digest = hashlib.sha256()
        with open(_local(path), "rb") as f:
            while chunk := f.read(block):
                digest.update(chunk)
        return digest.hexdigest()

    def remove(self, path: str) -> None:
        try:
            os.unlink(_local(path))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(_local(path), ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(_local(src), _local(dst))
        _fsync_dir(os.path.dirname(_local(dst)) or ".")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_for(uri: str) -> LocalStorage:
    """The storage backend that serves `uri` (local paths and file:// today)."""
    if "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        raise ValueError(f"storage scheme {scheme!r} in {uri!r} is not supported yet; use a local or shared (NFS) path")
    return LocalStorage()
