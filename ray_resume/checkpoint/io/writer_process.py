"""An async save's writer in a process of its own: the rank copies its share, the writer writes it.

A writer thread shares the rank's interpreter (its GIL) and its scheduling with
training. Here the rank copies its share into snapshot buffers in shared memory
(`writer.SnapshotBuffers(shared=True)`, memfds reused across saves), hashing it
as it copies (xxh3; sha256 is left to the writer), and a writer process beside
it writes and fsyncs every shard file from them. It is started once: with the
checkpointer when `async_writer: process`, at the first save whose share is
large enough under `auto`. It runs in the
lowest scheduling class (SCHED_IDLE: below Ray's workers at nice 15 and
anything niced), so its work takes what the training loop leaves, and imports
no torch. It needs little: past the page cache, a 328 MB share hashed by the
rank costs it ~0.02 s of CPU (benchmarks/README.md), so it is not paced; the
next save waits for it (with sha256 it has the hashing to do, in the same class).

What does not change: the rank's writer thread still waits for the writer and
reports the manifest to the driver, so a commit still needs a live rank whose
every shard is durable. A rank that dies takes its writer with it
(PR_SET_PDEATHSIG, and the socket's end): nothing it wrote is reported. A
writer that dies fails that save only (`WriterDied`); the next save starts a
new one. Storage errors come back as the same exception types a thread raises.
"""

from __future__ import annotations

import base64
import ctypes
import importlib
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ... import wire
from ...errors import WriterDied
from .shard_file import ShardFile, write_file
from .storage import storage_for, wrappers

PR_SET_PDEATHSIG = 1


# --- what the rank and its writer say to each other (wire: one class each, checked where received) -----


@dataclass(frozen=True)
class Setup:
    uri: str  # the checkpoint root
    storage: dict | None  # its storage options (config.StorageConfig's fields)
    wrappers: list  # (module, function, args) that install each storage wrapper of the rank's (the tests')


@dataclass(frozen=True)
class Buffer:
    kind: str  # a snapshot buffer of this kind's shards, its memfd beside the message
    nbytes: int


@dataclass(frozen=True)
class ToWrite:
    path: str
    kind: str
    head: str  # the file's header, base64
    ends: list  # where each checksum block ends (ShardFile.ends)
    data: list  # (start, bytes) of its data section in the kind's buffer
    digests: list | None  # ShardFile.digests: its blocks' digests, where the rank hashed them as it copied


@dataclass(frozen=True)
class Write:
    checksum: str
    pause_mid: bool  # an injected fault's: a Halfway and a Go per file, else no round trip
    files: list

    def __post_init__(self):
        object.__setattr__(self, "files", [f if isinstance(f, ToWrite) else ToWrite(**f) for f in self.files])


@dataclass(frozen=True)
class Written:
    written: list  # (size, block digests) of each file


@dataclass(frozen=True)
class Failed:
    error: dict  # _described(exc)


@dataclass(frozen=True)
class Halfway:
    """Half of a file is written: the rank runs its mid-write hook, then says Go."""


@dataclass(frozen=True)
class Go:
    pass


# Below this many bytes of a rank's share, `auto` keeps the writer thread: the save is over in
# milliseconds either way, and a process adds a round trip and, at SCHED_IDLE, a wait for a core
# (measured: benchmarks/throughput.py, README).
PROCESS_MIN_BYTES = 64 << 20


def writes_in_a_process(ckpt, share_bytes: int | None) -> bool:
    """`checkpoint.async_writer` for this rank's async saves of `share_bytes` (None: not known yet).
    `auto` is a process where memfds exist (Linux), the rank has no GPU (a GPU's snapshot copy wants
    pinned memory, which the thread's buffers are) and the share is large enough to be worth it."""
    if not (ckpt.enable_save and ckpt.async_save) or ckpt.async_writer == "thread":
        return False
    if ckpt.async_writer == "process":
        return True
    return (
        share_bytes is not None
        and share_bytes >= PROCESS_MIN_BYTES
        and hasattr(os, "memfd_create")
        and not _cuda_available()
    )


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # a rank has imported it; this module does not
    return torch is not None and torch.cuda.is_available()


class ProcessWriter:
    """The rank's side: starts the writer, lends it the snapshot buffers, hands it each save's files."""

    def __init__(self, uri: str, storage_options: dict | None, buffers):
        self._uri, self._options = uri, storage_options
        self._buffers = buffers  # writer.SnapshotBuffers(shared=True): shared(kind) -> (fd, nbytes, generation)
        self._proc: subprocess.Popen | None = None
        self._conn: socket.socket | None = None
        self._lent: dict[str, int] = {}  # kind -> generation of the buffer the writer has mapped

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def ensure_started(self) -> None:
        """Start a writer unless one runs. Called on the training thread: PR_SET_PDEATHSIG fires when the
        thread that started the child ends, and the training thread outlives every save."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The writer imports what its rank can (the rank's sys.path), the storage wrappers included.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self._conn, self._lent = ours, {}
        weakref.finalize(self, _end, ours, self._proc)  # a checkpointer dropped mid-run ends its writer too
        wire.send(ours, Setup(self._uri, self._options, [w.rebuild for w in wrappers if hasattr(w, "rebuild")]))

    def write(
        self, files: list[ShardFile], checksum: str, on_mid_write: Callable[[], None] | None = None
    ) -> list[tuple[int, list[str]]]:
        """Have the writer write `files` from the snapshot buffers; (size, block digests) of each."""
        if self._conn is None:
            raise WriterDied("no writer process is running (it died after the previous save)")
        try:
            for kind in dict.fromkeys(f.kind for f in files):
                fd, nbytes, generation = self._buffers.shared(kind)
                if self._lent.get(kind) != generation:
                    wire.send(self._conn, Buffer(kind, nbytes), [fd])
                    self._lent[kind] = generation
            files_to_write = [
                ToWrite(
                    f.path,
                    f.kind,
                    base64.b64encode(f.head).decode(),
                    f.ends,
                    self._buffers.placed(f.kind),
                    None if f.digests is None else list(f.digests),
                )
                for f in files
            ]
            wire.send(self._conn, Write(checksum, on_mid_write is not None, files_to_write))
            while True:
                reply, _ = wire.receive(self._conn, (Written, Failed, Halfway), timeout=None)
                if not isinstance(reply, Halfway):
                    break
                on_mid_write()  # on the rank, as with a thread: a fault may kill the rank here
                wire.send(self._conn, Go())
        except OSError:  # ConnectionError, BrokenPipeError: the writer is gone, or cannot be reached
            pid = self._proc.pid
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # alive, but this save cannot reach it any more
                self._proc.kill()
                code = self._proc.wait()
            self.close()
            raise WriterDied(
                f"the writer process (pid {pid}) ended ({_how(code)}) while writing {', '.join(f.name for f in files)}"
            ) from None
        if isinstance(reply, Failed):
            raise _rebuilt(reply.error)
        return [(size, digests) for size, digests in reply.written]

    def close(self) -> None:
        """End the writer (it exits at the socket's end) and wait for it."""
        if self._proc is not None:
            _end(self._conn, self._proc)
        self._conn = self._proc = None


def _end(conn: socket.socket, proc: subprocess.Popen) -> None:
    conn.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _how(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _described(exc: BaseException) -> dict:
    if isinstance(exc, OSError) and exc.errno is not None:
        return {"errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename}
    return {"type": type(exc).__name__, "message": str(exc)}


def _rebuilt(error: dict) -> Exception:
    """The writer's exception as the rank would have raised it: an OSError keeps its errno (and so its
    subclass: FileNotFoundError, TimeoutError...), which the retry and error messages depend on."""
    if "errno" in error:
        args = (error["errno"], error["strerror"]) + ((error["filename"],) if error["filename"] is not None else ())
        return OSError(*args)
    return RuntimeError(f"{error['type']}: {error['message']}")


# --- the writer process -------------------------------------------------------------------------------


def serve(conn: socket.socket) -> None:
    storage, views = None, {}
    while True:
        try:
            msg, fds = wire.receive(conn, (Setup, Buffer, Write), timeout=None, max_fds=1)
        except OSError:  # the rank closed its end, or is gone (ConnectionError: or it said nonsense)
            return
        if isinstance(msg, Setup):
            for module, function, args in msg.wrappers:
                getattr(importlib.import_module(module), function)(*args)
            storage = storage_for(msg.uri, msg.storage)
        elif isinstance(msg, Buffer):
            views[msg.kind] = memoryview(_mapped(fds[0], msg.nbytes))
        else:
            try:
                halfway = (lambda: _halfway(conn)) if msg.pause_mid else None
                written = []
                for f in msg.files:
                    start, nbytes = f.data
                    digests = None if f.digests is None else tuple(f.digests)
                    file = ShardFile(f.path, f.kind, base64.b64decode(f.head), f.ends, digests)
                    written.append(
                        write_file(storage, file, [views[f.kind][start : start + nbytes]], msg.checksum, halfway)
                    )
                wire.send(conn, Written(written))
            except Exception as exc:  # reported to the rank, which raises it where a thread would have
                wire.send(conn, Failed(_described(exc)))


def _mapped(fd: int, nbytes: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _halfway(conn: socket.socket) -> None:
    """Half of a file is written: the rank runs its mid-write hook, then lets the write go on."""
    wire.send(conn, Halfway())
    wire.receive(conn, (Go,), timeout=None)


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the line above took effect
        return 1
    try:  # the writer takes the CPU time training leaves
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # a kernel or sandbox without it
        os.nice(19)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # into its rank's log, as the rank's lines
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is its rank's to handle; it ends with its rank
    serve(socket.socket(fileno=fd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
