"""What the soak (benchmarks/soak.py) puts inside a job's processes, and the power cut it models.

`prepare(journal, log, mutations)` runs in every process of a job as it starts (the harness's
`setup`): every fsync is written down in `journal` (the file's inode, size and mtime), what the
process prints goes to `log`, and each named mutation breaks the product on purpose, so that a
test can show the soak catches it. (A rank's writer process is not prepared: the soak's shares are
small enough for the writer thread.)

A power cut (`lose_unsynced`) then does to a root what losing a node's page cache does: a file
whose bytes, as they are now, were never fsynced is gone (a file is known by inode, size and
mtime: inodes are reused, and a file changed after its fsync has a new mtime). Renames and directory entries are taken as durable (the model is of file data only), and the
lease directory is left alone: it is the driver's, written by the submitting machine.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

from ray_resume.checkpoint.io.lease import LEASE_DIR
from ray_resume.plugins import next_token_loss


def prepare(journal: str, log: str, mutations: tuple[str, ...] = ()) -> None:
    """Journal this process's fsyncs into `journal`; apply `mutations` (names of MUTATIONS). What the
    process prints goes to `log`: the soak's console is its own lines."""
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    journal_fsyncs(journal)
    for name in mutations:
        MUTATIONS[name]()


def journal_fsyncs(journal: str) -> None:
    real = getattr(os.fsync, "real", os.fsync)

    def fsync(fd: int) -> None:
        real(fd)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):  # one short O_APPEND write: lines from many processes never interleave
            out = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(out, f"{_identity(st)}\n".encode())
            finally:
                os.close(out)

    fsync.real = real
    os.fsync = fsync


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns}"


def lose_unsynced(root: str, journal: str) -> list[str]:
    """A power cut's effect on the files under `root`; the paths (relative to it) it removed."""
    synced = set(Path(journal).read_text().splitlines()) if os.path.exists(journal) else set()
    lost = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != LEASE_DIR]
        for name in files:
            path = os.path.join(directory, name)
            if _identity(os.stat(path)) not in synced:
                os.unlink(path)
                lost.append(os.path.relpath(path, root))
    return sorted(lost)


def freeze_and_kill(pids: list[int], while_frozen) -> None:
    """SIGSTOP every pid (nothing runs on from here), call `while_frozen()`, then SIGKILL them."""
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if signum == signal.SIGSTOP:
            while_frozen()


def slow_loss(marks: str, step_sleep: float, model, batch):
    """The built-in loss (the same numbers), `step_sleep` s slower per micro-batch so that faults land in
    training; each process that computes it touches a file named by its pid in `marks`: a rank that trains."""
    (Path(marks) / str(os.getpid())).touch()
    time.sleep(step_sleep)
    return next_token_loss(model, batch)


class NoticeAt:
    """Ray Train's preemption notice, from the wall time written in the file `at` on (the soak writes it
    once training has begun); `marker` is created when the notice was given."""

    def __init__(self, at: str, marker: str):
        self.at, self.marker = at, marker

    def __call__(self) -> bool:
        try:
            due = float(Path(self.at).read_text())
        except (FileNotFoundError, ValueError):  # not written yet, or being written
            return False
        if time.time() < due:
            return False
        Path(self.marker).touch()
        return True


# ----------------------------------------------------------------------------- mutations: bugs on purpose


class _OsWithoutFsync:
    """The os module with an fsync that does nothing."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def fsync(fd: int) -> None:
        pass


def no_fsync() -> None:
    """The storage layer's fsyncs (shards, JSON, tracker) removed: a commit that is not durable."""
    from ray_resume.checkpoint.io import direct_io, storage

    storage.os = direct_io.os = _OsWithoutFsync()


def cursor_off_by_one() -> None:
    """A resumed data stream starts one step ahead of where the checkpoint says."""
    from ray_resume.data import stream

    init = stream.SampleStream.__init__

    def shifted(self, source, seed, shuffle, global_batch_size, rank=0, world_size=1, start_sample=0, *args, **kwargs):
        start_sample += global_batch_size if start_sample else 0
        init(self, source, seed, shuffle, global_batch_size, rank, world_size, start_sample, *args, **kwargs)

    stream.SampleStream.__init__ = shifted


MUTATIONS = {"no_fsync": no_fsync, "cursor_off_by_one": cursor_off_by_one}
