"""One writer per save_path: a lease in the root, taken atomically, renewed while the job lives,
and checked by every commit (fencing).

Two jobs writing one root would interleave iterations and fight over the
tracker. The lease is a series of generation files, `.writer-lease/<gen>.json`;
the newest generation is the lease. Taking it (a fresh root, or a dead job's
lease once it has expired) creates the next generation, and only one job
can create a given generation:

* POSIX (local disk, NFS): the record is written to a temp file and hard
  linked to its name, which fails if the name exists (atomic, NFS included).
* Object storage: pyarrow offers no conditional PUT, so a generation is
  created if absent and read back after `SETTLE_S`; of two jobs creating
  one generation at the same instant, the one whose PUT landed last holds
  it and the other refuses. Two jobs can both pass this only if their PUTs
  are more than `SETTLE_S` apart yet each checked before the other wrote
  (one request's latency); the commit's fence then stops the one whose
  record was overwritten before it writes anything.

The driver takes the lease before anything is written and renews it every
ttl/3 from that moment to the job's end. Every commit calls `check()` before
it writes JSON and again before it moves the tracker: the newest generation
must still be this job's and valid for at least another ttl/3. A job that
stalled past its lease (and was taken over) or whose renewals fail stops
with `LeaseLost`; the remaining window is the time between the check and
the tracker write, which the ttl/3 margin covers.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from ..format import paths
from ...errors import CheckpointError, LeaseLost

logger = logging.getLogger(__name__)

LEASE_DIR = ".writer-lease"
SETTLE_S = 2.0  # object storage: wait this long before reading a new generation back


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


class Lease:
    def __init__(self, storage, root: str, job_id: str, ttl_s: float):
        self.storage, self.root, self.dir = storage, root, paths.join(root, LEASE_DIR)
        self.job_id, self.ttl_s = job_id, ttl_s
        self.record = {"job_id": job_id, "host": socket.gethostname(), "pid": os.getpid()}
        self.generation: int | None = None
        self._stop = threading.Event()
        self._renewing: threading.Thread | None = None

    def _path(self, generation: int) -> str:
        return paths.join(self.dir, f"{generation:08d}.json")

    def _generations(self) -> list[int]:
        return sorted(int(n[:-5]) for n in self.storage.listdir(self.dir) if n.endswith(".json") and n[:-5].isdigit())

    def _read(self, generation: int) -> dict:
        try:
            return json.loads(self.storage.read_bytes(self._path(generation)))
        except (ValueError, FileNotFoundError):
            return {}  # a garbled (or just released) lease protects nothing: treat it as expired

    def _newest(self) -> tuple[int, dict] | None:
        generations = self._generations()
        return (generations[-1], self._read(generations[-1])) if generations else None

    def _data(self) -> bytes:
        return json.dumps(
            {**self.record, "generation": self.generation, "expires_at": time.time() + self.ttl_s}
        ).encode()

    def acquire(self) -> None:
        """Take the lease (create the next generation), or raise naming the live job that holds it."""
        self.storage.makedirs(self.dir)
        newest = self._newest()
        generation, held = newest if newest else (0, {})
        if newest and held.get("job_id") == self.job_id and not held.get("released"):
            self.generation = generation  # the same job again: it holds it already
            return
        if newest and held.get("expires_at", 0) > time.time() and not _dead_here(held):
            raise CheckpointError(
                f"checkpoint.save_path {self.root!r} is being written by job {held.get('job_id')} "
                f"(host {held.get('host')}, pid {held.get('pid')}); its lease ({self._path(generation)}) runs until "
                f"{time.strftime('%H:%M:%S', time.localtime(held['expires_at']))} and is renewed while that job lives. "
                "Stop that job or use another save_path; a dead job's lease expires by itself."
            )
        if newest and not held.get("released"):
            logger.warning("taking over the expired lease of job %s on %s", held.get("job_id"), self.root)
        self.generation = generation + 1
        if not self._create(self._path(self.generation), self._data()):
            raise CheckpointError(
                f"{self._path(self.generation)}: another job took the lease of {self.root!r} at the same moment; try again"
            )
        for old in self._generations():  # the series stays one file long
            if old < self.generation:
                self.storage.remove(self._path(old))

    def _create(self, path: str, data: bytes) -> bool:
        """Create `path` holding `data` unless it exists; False if another job's is there."""
        create_new = getattr(self.storage, "create_new", None)
        if create_new:
            return create_new(path, data)
        if self.storage.size(path) is not None:
            return False
        self.storage.write_atomic(path, data)
        time.sleep(SETTLE_S)  # a concurrent PUT of the same generation lands within this, and wins
        return self._read_owner(path) == self.job_id

    def _read_owner(self, path: str) -> str | None:
        try:
            return json.loads(self.storage.read_bytes(path)).get("job_id")
        except (ValueError, OSError):
            return None

    def check(self) -> None:
        """Raise `LeaseLost` unless this job's lease is the newest and valid for another ttl/3 (the commit's fence)."""
        newest = self._newest()
        if newest is None or newest[1].get("job_id") != self.job_id:
            holder = newest[1].get("job_id") if newest else None
            raise LeaseLost(
                f"this job ({self.job_id}) no longer holds the writer lease of {self.root}"
                + (f": job {holder} took it over" if holder else ": it was removed")
            )
        left = newest[1].get("expires_at", 0) - time.time()
        if left < self.ttl_s / 3:
            raise LeaseLost(
                f"the writer lease of {self.root} runs out in {left:.0f} s (renewals are failing); "
                "committing now could race a job that takes it over"
            )

    def renew(self) -> None:
        """Extend this job's generation while it is the newest; otherwise the lease is lost (leave it)."""
        newest = self._generations()
        if not newest or newest[-1] != self.generation:
            raise LeaseLost(f"the writer lease of {self.root} is no longer this job's generation {self.generation}")
        self.storage.write_atomic(self._path(self.generation), self._data())

    def keep_renewed(self) -> None:
        """Renew every ttl/3 from a daemon thread until `release`."""

        def loop():
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                except LeaseLost:
                    logger.error(
                        "the writer lease of %s was taken by another job; this job's commits will fail", self.root
                    )
                    return
                except OSError:
                    logger.exception("could not renew the writer lease of %s", self.root)

        self._renewing = threading.Thread(target=loop, daemon=True, name="lease-renewal")
        self._renewing.start()

    def release(self) -> None:
        """Stop renewing and mark this generation released (expired at once). It is not deleted:
        generation numbers never restart, so a stalled job holding an older one can never pass for
        the holder again."""
        self._stop.set()
        if self._renewing:
            self._renewing.join()  # a renewal mid-write would otherwise extend the lease again
        if self.generation is not None and self._read_owner(self._path(self.generation)) == self.job_id:
            record = {**self.record, "generation": self.generation, "expires_at": 0, "released": True}
            self.storage.write_atomic(self._path(self.generation), json.dumps(record).encode())
