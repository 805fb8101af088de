"""The one place that touches checkpoint storage: local/NFS paths and s3://.

Every write that a reader may race with is atomic. On POSIX small files go
to a temp name, are fsynced and renamed (rename replaces atomically), and
the directory is fsynced so the rename itself survives a power cut. On
object storage a PUT is atomic by itself. Shards are written in place; they
are only trusted after the commit has checked their size and recorded their
checksum (invariant 4). Ranks write straight to the store: no local staging
copy on either backend, and on POSIX none in the page cache either where the
file system takes O_DIRECT (`direct_io`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Protocol

from . import direct_io
from .object_store import ArrowStorage, s3_filesystem
from ..format import paths

logger = logging.getLogger(__name__)

# Streamed reads (verification, whole-shard loads) hold one block at a time.
READ_BLOCK = 8 << 20

TEMP_MARK = ".tmp-"  # a file written atomically is PATH + TEMP_MARK + 8 hex digits until its rename

# Transient storage errors are retried: ATTEMPTS tries, waiting BACKOFF_S, 2x, 4x... between them (3 s in all).
ATTEMPTS = 5
BACKOFF_S = 0.2
_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EAGAIN,
    errno.EINTR,
    errno.EPIPE,
    errno.ESTALE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
}
# What pyarrow's S3 errors (OSError without an errno) say when a retry may help; its own
# retry strategy has already retried the request itself.
_TRANSIENT_S3 = (
    "NETWORK_CONNECTION",
    "SLOW_DOWN",
    "THROTTL",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "REQUEST_TIMEOUT",
    "HTTP status 5",
    "curlCode",
)


def transient(exc: BaseException) -> bool:
    """A storage error that may pass if tried again (I/O error, timeout, reset, 5xx, throttling); never damage."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if not isinstance(exc, OSError) or isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError)):
        return False
    if exc.errno is not None:
        return exc.errno in _TRANSIENT_ERRNOS
    return any(marker in str(exc) for marker in _TRANSIENT_S3)


def retried(call: Callable, what: str):
    """`call()`, tried again with bounded backoff while it fails transiently; the last error is raised."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except OSError as exc:
            if attempt == ATTEMPTS or not transient(exc):
                raise
            wait = BACKOFF_S * 2 ** (attempt - 1)
            logger.warning("storage: %s failed (%s); try %d of %d in %.1f s", what, exc, attempt + 1, ATTEMPTS, wait)
            time.sleep(wait)


class LocalStorage:
    """A local or network (NFS) file system reached through POSIX calls."""

    def makedirs(self, path: str) -> None:
        os.makedirs(paths.local_path(path), exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(paths.local_path(path))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(paths.local_path(path))

    def size(self, path: str) -> int | None:
        """The file's size in bytes, or None when it does not exist."""
        try:
            return os.stat(paths.local_path(path)).st_size
        except FileNotFoundError:
            return None

    def sizes(self, directory: str, names: list[str]) -> dict[str, int | None]:
        """The size of each of `names` in `directory` (None: not there): one stat each."""
        return {n: self.size(f"{directory}/{n}") for n in names}

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(paths.local_path(path)))
        except FileNotFoundError:
            return []

    def read_bytes(self, path: str) -> bytes:
        with open(paths.local_path(path), "rb") as f:
            return f.read()

    def open_read(self, path: str):
        """A seekable binary file with `readinto` (unbuffered: bytes land in the caller's buffer)."""
        return open(paths.local_path(path), "rb", buffering=0)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with open(paths.local_path(path), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise OSError(errno.EIO, f"short read: wanted {length} bytes at {offset}, got {len(data)}", path)
        return data

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write `data` so that a reader sees the old file or the new one, never half."""
        self._publish(path, data, os.replace)

    def create_new(self, path: str, data: bytes) -> bool:
        """Create `path` holding `data` unless it exists (atomic: a hard link never replaces); False if it did."""
        try:
            self._publish(path, data, os.link)
        except FileExistsError:
            return False
        return True

    def _publish(self, path: str, data: bytes, move) -> None:
        """`data` fsynced under a temp name, then `move`d (renamed or linked) to `path`, the directory fsynced."""
        local = paths.local_path(path)
        tmp = f"{local}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            move(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(os.path.dirname(local) or ".")

    def write_durable(self, path: str, chunks: Iterable[bytes], digest) -> int:
        """Stream `chunks` into `path`, fsync, and return the size; `digest` hashes each chunk while it is written.
        Past the page cache where the file system takes O_DIRECT; through it, as the same bytes, elsewhere."""
        local = paths.local_path(path)
        directory = os.path.dirname(local) or "."
        size = direct_io.write(local, chunks, digest)
        if size is not None:
            _fsync_dir(directory)
            return size
        direct_io.say_buffered(directory)
        size = 0
        with open(local, "wb") as f:
            for chunk in chunks:
                digest.update(chunk)
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(directory)
        return size

    def remove(self, path: str) -> None:
        try:
            os.unlink(paths.local_path(path))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(paths.local_path(path), ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(paths.local_path(src), paths.local_path(dst))
        _fsync_dir(os.path.dirname(paths.local_path(dst)) or ".")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Storage(Protocol):
    """What every storage of a root does: `LocalStorage`, `ArrowStorage`, and `Retrying` around
    either (what `storage_for` gives, and so what every caller holds at run time)."""

    def makedirs(self, path: str) -> None: ...
    def exists(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def size(self, path: str) -> int | None: ...
    def sizes(self, directory: str, names: list[str]) -> dict[str, int | None]: ...
    def listdir(self, path: str) -> list[str]: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_read(self, path: str): ...
    def read_range(self, path: str, offset: int, length: int) -> bytes: ...
    def write_atomic(self, path: str, data: bytes) -> None: ...
    def write_durable(self, path: str, chunks: Iterable[bytes], digest) -> int: ...
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...


class Retrying:
    """A backend whose idempotent calls are `retried`. Streams (`write_durable`, `open_read`) are
    retried by their callers, whole file by whole file; `create_new` and `rename` are not
    idempotent and are not retried."""

    IDEMPOTENT = frozenset(
        {
            "makedirs",
            "exists",
            "is_dir",
            "size",
            "sizes",
            "listdir",
            "read_bytes",
            "read_range",
            "write_atomic",
            "remove",
            "remove_tree",
        }
    )

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name: str):
        if name == "backend" or name.startswith("__"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        attr = getattr(self.backend, name)
        if name not in self.IDEMPOTENT:
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            return retried(lambda: attr(*args, **kwargs), f"{name} {args[0] if args else ''}")

        return call


# Wrappers applied to every backend below the retries, each called as wrap(backend, uri) (the tests'
# storage fault injector). A wrapper with `rebuild = (module, function, args)` is installed in a rank's
# writer process too, by calling that function there.
wrappers: list[Callable] = []


def storage_for(uri: str, options=None) -> Retrying:
    """The backend that serves `uri`, with retries; `options` is a config.StorageConfig (or None: environment only)."""
    if not paths.on_object_storage(uri):
        backend = LocalStorage()
    else:
        scheme = uri.split("://", 1)[0]
        if scheme != "s3":
            raise ValueError(
                f"storage scheme {scheme!r} in {uri!r} is not supported; use a local/NFS path, file:// or s3://"
            )
        backend = ArrowStorage(s3_filesystem(options), scheme)
    for wrap in wrappers:
        backend = wrap(backend, uri)
    return Retrying(backend)
