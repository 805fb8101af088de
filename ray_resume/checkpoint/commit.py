"""Driver-side commit: the only writer of metadata.json, common.json and the tracker.

`CheckpointCoordinator` is a Ray actor owned by the driver. It outlives
worker-group restarts (it is not part of the group), so it is also where a
restarted group learns which iteration this job last committed. Ranks send
their manifest after their shards are durable; when all `world_size`
manifests of an iteration from the *current* attempt are in, the commit
checks every file's size, writes metadata.json and common.json atomically,
and moves the tracker last (invariant 4). Manifests from an older attempt
are dropped: their rank may have been killed mid-way and a new attempt is
rewriting the same files. Actor methods run one at a time, so a commit and
a restarted group asking "what is committed?" never interleave.

The commit itself (`commit_iteration`) is a plain function of storage and
manifests, so it can be driven without Ray (`benchmarks/scale_sim.py` runs it
for 16,384 ranks). It costs O(ranks + tensors): one size check per file (on
object storage, one LIST page per 1,000 files instead of one HEAD per file),
then four small atomic writes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import ray
import yaml

from . import layout
from .lease import Lease
from .schema import CKPT_STATUS_OK, build_metadata, dumps, validate_metadata
from .storage import storage_for

logger = logging.getLogger(__name__)


def commit_iteration(
    storage,
    root: str,
    iteration: int,
    manifests: list[dict],
    common: dict,
    *,
    prefix: str,
    config: dict,
    job_id: str,
    before_tracker: Callable[[], None] = lambda: None,
) -> dict:
    """Commit `iteration` from every rank's manifest (`manifests[r]` is rank r's); return its metadata.

    Checks that every reported file is on storage with its reported size and
    that the metadata lists every rank's shard of every kind, then writes
    metadata.json, config.yaml and common.json (rank 0's `common` completed
    here), calls `before_tracker` (fault injection), and moves the tracker
    last. Raises on any mismatch, before the tracker moves.
    """
    world = len(manifests)
    for rank, manifest in enumerate(manifests):
        if manifest["rank"] != rank or manifest["world_size"] != world:
            raise RuntimeError(f"manifest {rank} is from rank {manifest['rank']} of {manifest['world_size']}, expected rank {rank} of {world}")
    iter_dir = layout.iteration_dir(root, iteration)
    reported = {name: (manifest["rank"], info["size"]) for manifest in manifests for name, info in manifest["files"].items()}
    on_storage = storage.sizes(iter_dir, list(reported))
    for name, (rank, size) in reported.items():
        if on_storage[name] != size:
            raise RuntimeError(f"rank {rank} reported {name} with {size} bytes, storage has {on_storage[name]}")
    metadata = build_metadata(iteration, prefix, manifests)
    validate_metadata(metadata, layout.join(iter_dir, layout.METADATA))  # refuse to commit what a reader would refuse
    common = dict(common)
    common.update(
        format_version=layout.FORMAT_VERSION, ckpt_status=CKPT_STATUS_OK, world_size=world,
        job_id=job_id, saved_at=time.time(), has_optimizer=layout.OPTIM_KIND in metadata["tensors"],
    )
    storage.write_atomic(layout.join(iter_dir, layout.METADATA), dumps(metadata))
    storage.write_atomic(layout.join(iter_dir, layout.CONFIG), yaml.safe_dump(config, sort_keys=False).encode())
    storage.write_atomic(layout.join(iter_dir, layout.COMMON), dumps(common))
    before_tracker()
    storage.write_atomic(layout.tracker_path(root), f"{iteration}\n".encode())
    return metadata


@ray.remote(num_cpus=0, max_restarts=0)
class CheckpointCoordinator:
    def __init__(self, save_path: str, job_id: str, config: dict, driver_pid: int):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        self.root = save_path
        self.job_id = job_id
        self.config = config
        self.driver_pid = driver_pid
        self.fault = config.get("fault")
        self.storage = storage_for(save_path, config["checkpoint"]["storage"]) if save_path else None
        self.attempt = -1
        self.pending: dict[int, dict[int, dict]] = {}  # iteration -> rank -> manifest
        self.pending_common: dict[int, dict] = {}  # iteration -> rank 0's common
        self.committed_by_job: list[int] = []
        self.fault_claimed = False
        self.final_metrics: dict = {}
        self.stop_requested = False
        self.lease = None
        if self.storage and config["checkpoint"]["enable_save"]:
            # The driver took the lease; this actor outlives worker restarts, so it renews it.
            self.lease = Lease(self.storage, save_path, job_id, config["checkpoint"]["lease_ttl_s"])
            self.lease.keep_renewed()

    def start_attempt(self) -> dict:
        """Called once per worker-group start by rank 0: a new attempt id, and what to resume."""
        self.attempt += 1
        self.pending.clear()
        self.pending_common.clear()
        last = self.committed_by_job[-1] if self.committed_by_job else None
        return {"attempt": self.attempt, "resume_step": last}

    def claim_fault(self) -> bool:
        """True exactly once per job: the injected fault fires a single time."""
        if self.fault_claimed:
            return False
        self.fault_claimed = True
        return True

    def request_stop(self) -> None:
        """Preemption: the ranks save at the next step boundary and end the run cleanly."""
        self.stop_requested = True

    def should_stop(self) -> bool:
        return self.stop_requested

    def release(self) -> None:
        """The job is over: stop renewing and give the save_path back."""
        if self.lease:
            self.lease.release()

    def finish(self, metrics: dict) -> None:
        """Rank 0's last step metrics, for the driver's result."""
        self.final_metrics = metrics

    def result(self) -> dict:
        return {"committed": self.last_committed(), "metrics": self.final_metrics}

    def last_committed(self) -> int | None:
        return self.committed_by_job[-1] if self.committed_by_job else None

    def report(self, attempt: int, iteration: int, manifest: dict, common: dict) -> bool:
        """A rank's shards of `iteration` are durable. Returns True if this completed a commit.

        Only what the commit needs is held: each rank's manifest, and rank 0's
        `common` (the ranks' copies are the same).
        """
        if attempt != self.attempt:
            logger.info("ignoring a manifest of iteration %d from attempt %d (now %d)", iteration, attempt, self.attempt)
            return False
        got = self.pending.setdefault(iteration, {})
        got[manifest["rank"]] = manifest
        if manifest["rank"] == 0:
            self.pending_common[iteration] = common
        if len(got) < manifest["world_size"]:
            return False
        del self.pending[iteration]
        common = self.pending_common.pop(iteration, None)
        try:
            if common is None or sorted(got) != list(range(len(got))):
                raise RuntimeError(f"iteration {iteration}: manifests came from ranks {sorted(got)[:8]}..., not 0..{len(got) - 1}")
            self._commit(iteration, [got[rank] for rank in range(len(got))], common)
            return True
        except Exception:  # never raise into Ray: a failed commit just leaves the tracker where it was
            logger.exception("commit of iteration %d failed; the tracker stays on the previous iteration", iteration)
            return False

    def _commit(self, iteration: int, manifests: list[dict], common: dict) -> None:
        metadata = commit_iteration(
            self.storage, self.root, iteration, manifests, common, prefix=self.config["checkpoint"]["prefix"],
            config=self.config, job_id=self.job_id, before_tracker=lambda: self._maybe_kill_driver(iteration),
        )
        self.committed_by_job.append(iteration)
        logger.info("committed iteration %d (%d shards) at %s", iteration, len(metadata["files"]), layout.iteration_dir(self.root, iteration))
        self._apply_retention(iteration)

    def _apply_retention(self, tracked: int) -> None:
        """Keep the newest `save_max` iterations this job committed; remove older ones of this job only.

        Runs after the tracker has moved (a failed deletion never costs the
        newest commit). Iterations of earlier jobs under the same root, such
        as the one this job resumed from, are never in `committed_by_job`.
        """
        keep = self.config["checkpoint"]["save_max"]
        while len(self.committed_by_job) > keep:
            victim = self.committed_by_job.pop(0)
            if victim != tracked:
                self._delete_iteration(victim)

    def _delete_iteration(self, step: int) -> None:
        """Crash-safe: common.json goes first, so a half-deleted dir can never pass as complete."""
        iter_dir = layout.iteration_dir(self.root, step)
        self.storage.remove(layout.join(iter_dir, layout.COMMON))
        f = self.fault
        if f and f["phase"] == "retention_delete" and f["step"] == step and self.claim_fault():
            self._kill_driver(f"while deleting iteration {step}")
        self.storage.remove_tree(iter_dir)
        logger.info("retention (save_max=%d): removed iteration %d", self.config["checkpoint"]["save_max"], step)

    def _maybe_kill_driver(self, iteration: int) -> None:
        f = self.fault
        if f and f["phase"] == "commit_before_tracker" and f["step"] == iteration and self.claim_fault():
            self._kill_driver(f"before moving the tracker to {iteration}")

    def _kill_driver(self, when: str) -> None:
        # The whole job dies, as when the head node is lost: the driver and this actor with it.
        print(f"[fault] killing the driver (pid {self.driver_pid}) {when}", flush=True)
        os.kill(self.driver_pid, signal.SIGKILL)
        os._exit(1)
