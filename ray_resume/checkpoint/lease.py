"""One writer per save_path: a lease file in the root, renewed while the job lives.

Two jobs writing one root would interleave iterations and fight over the
tracker. The driver takes the lease before anything is written; the
controller renews it every ttl/3 for as long as the job runs, so worker
restarts and resizes (same job, same controller) keep it. A job that dies
stops renewing, and its lease can be taken over once it has expired.
Object stores have no compare-and-swap here, so taking a lease writes it and
reads it back: of two jobs starting in the same instant one sees the other's
name and refuses.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from . import layout
from .schema import CheckpointError

logger = logging.getLogger(__name__)

LEASE = ".writer-lease.json"


def _dead_here(held: dict) -> bool:
    """A holder on this host whose driver process is gone needs no waiting for its lease to expire."""
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return False
    try:
        os.kill(held["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read(storage, path: str) -> dict | None:
    if storage.size(path) is None:
        return None
    try:
        return json.loads(storage.read_bytes(path))
    except (ValueError, OSError):
        return None  # a garbled lease protects nothing: treat it as expired


class Lease:
    def __init__(self, storage, root: str, job_id: str, ttl_s: float):
        self.storage, self.root, self.path = storage, root, layout.join(root, LEASE)
        self.job_id, self.ttl_s = job_id, ttl_s
        self.record = {"job_id": job_id, "host": socket.gethostname(), "pid": os.getpid()}
        self._stop = threading.Event()

    def _write(self) -> None:
        self.storage.write_atomic(self.path, json.dumps({**self.record, "expires_at": time.time() + self.ttl_s}).encode())

    def acquire(self) -> None:
        """Take the lease, or raise naming the live job that holds it."""
        self.storage.makedirs(self.root)
        held = _read(self.storage, self.path)
        if held and held.get("job_id") != self.job_id and held.get("expires_at", 0) > time.time() and not _dead_here(held):
            raise CheckpointError(
                f"checkpoint.save_path {self.root!r} is being written by job {held.get('job_id')} "
                f"(host {held.get('host')}, pid {held.get('pid')}); its lease ({self.path}) runs until "
                f"{time.strftime('%H:%M:%S', time.localtime(held['expires_at']))} and is renewed while that job lives. "
                "Stop that job or use another save_path; a dead job's lease expires by itself."
            )
        if held and held.get("job_id") != self.job_id:
            logger.warning("taking over the expired lease of job %s on %s", held.get("job_id"), self.path)
        self._write()
        if (_read(self.storage, self.path) or {}).get("job_id") != self.job_id:
            raise CheckpointError(f"{self.path}: another job took the lease at the same moment; try again")

    def keep_renewed(self) -> None:
        """Renew every ttl/3 from a daemon thread until `release`."""

        def loop():
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self._write()
                except OSError:
                    logger.exception("could not renew the writer lease %s", self.path)

        threading.Thread(target=loop, daemon=True, name="lease-renewal").start()

    def release(self) -> None:
        self._stop.set()
        if (_read(self.storage, self.path) or {}).get("job_id") == self.job_id:
            self.storage.remove(self.path)
