"""Retention on the job's controller: keep the newest `save_max` iterations this job committed,
deleting older ones of this job only, crash-safe, on a thread of its own; and clear what crashes
left below the newest commit that nothing can ever load.

A mixin of `JobController` (the harness overrides `_remove_iteration` to slow it down).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..checkpoint.format import paths
from ..checkpoint.io.iterations import read_tracker
from ..checkpoint.io.lease import Lease
from ..checkpoint.io.storage import TEMP_MARK, Storage
from ..config import Config
from ..faults import Fault

logger = logging.getLogger("ray_resume.controller")


class Retention:
    # JobController's, which this mixin reads and keeps up
    config: Config
    root: str
    storage: Storage
    deleter: ThreadPoolExecutor  # one thread: deletions in commit order, off the commit's path
    fault: Fault | None
    attempt: int
    lease: Lease | None
    committed_by_job: list[int]
    complete_below: set[int]
    failed_commits: set[int]
    claim_fault: Callable[[], bool]
    _kill_driver: Callable[[str], None]

    def _apply_retention(self, tracked: int) -> None:
        """Keep the newest `save_max` iterations this job committed; remove older ones of this job only.

        Runs after the tracker has moved (a failed deletion never costs the
        newest commit), on the deletion thread: a slow `rmtree` holds up
        neither the ranks nor the next commit. Iterations of earlier jobs
        under the same root, such as the one this job resumed from, are
        never in `committed_by_job`.
        """
        keep = self.config.checkpoint.save_max
        while len(self.committed_by_job) > keep:
            victim = self.committed_by_job.pop(0)
            if victim != tracked:
                self.deleter.submit(self._delete_iteration, victim)
        self.deleter.submit(self._clear_uncommitted, tracked, self.attempt)

    def clear_below_tracker(self) -> None:
        """As the job ends: `_clear_uncommitted` below what the tracker names now (a job with nothing left
        to train commits nothing, and so clears nothing after a commit)."""
        try:
            tracked = read_tracker(self.storage, self.root)
        except Exception:  # a garbled tracker is the next load's to report
            logger.exception("could not read the tracker of %s", self.root)
            return
        if tracked is not None:
            self.deleter.submit(self._clear_uncommitted, tracked, self.attempt, ended=True)

    def _clear_uncommitted(self, tracked: int, attempt: int, ended: bool = False) -> None:
        """Remove the iteration directories below `tracked` that were never committed: those without a
        common.json (a save a crash cut short that no later save replaced, one off the interval for a
        preemption; a deletion a crash cut short) and those whose commit failed in this job (written
        whole, the tracker never moved to them). The tracker never names them (a commit writes
        common.json before the tracker). No save writes below the newest commit of the attempt that
        asked, so a clear asked by an earlier attempt is dropped (a restart may have fallen back below
        it). As the job `ended`, also a tracker's temporary file a crash left (while it runs, one may be
        this job's commit's). Only while this job holds the lease; a directory whose common.json cannot
        be looked at (an I/O error, not its absence) is left alone."""
        try:
            if attempt != self.attempt:
                return
            self.lease.check()
            names = self.storage.listdir(self.root)
        except Exception as exc:  # LeaseLost, or the lease or the root could not be read: clear nothing
            logger.warning("not clearing uncommitted iterations of %s: %s", self.root, exc)
            return
        for name in names:
            step = paths.parse_iteration_dirname(name)
            # a crash cut a tracker write short before its rename
            if ended and name.startswith(paths.TRACKER + TEMP_MARK):
                try:
                    self.storage.remove(paths.join(self.root, name))
                except Exception:
                    logger.exception("could not remove %s under %s", name, self.root)
            elif step is not None and step < tracked and step not in self.complete_below:
                self._clear_if_uncommitted(step)

    def _clear_if_uncommitted(self, step: int) -> None:
        iter_dir = paths.iteration_dir(self.root, step)
        try:
            if step not in self.failed_commits and self.storage.size(paths.join(iter_dir, paths.COMMON)) is not None:
                self.complete_below.add(step)
                return
            self.storage.remove_tree(iter_dir)
        except Exception:
            logger.exception("could not clear uncommitted iteration %d under %s", step, self.root)
            return
        self.failed_commits.discard(step)
        logger.info("removed iteration %d: never committed (a save, a commit or a deletion cut short)", step)

    def _delete_iteration(self, step: int) -> None:
        """Crash-safe: common.json goes first, so a half-deleted dir can never pass as complete.
        A failed deletion costs disk, not the run: it is logged, and the iteration stays."""
        try:
            self._remove_iteration(step)
        except Exception:
            logger.exception(
                "retention could not remove iteration %d; remove %s by hand", step, paths.iteration_dir(self.root, step)
            )

    def _remove_iteration(self, step: int) -> None:
        iter_dir = paths.iteration_dir(self.root, step)
        self.storage.remove(paths.join(iter_dir, paths.COMMON))
        f = self.fault
        if f and f.at("retention_delete", step) and self.claim_fault():
            self._kill_driver(f"while deleting iteration {step}")
        self.storage.remove_tree(iter_dir)
        logger.info("retention (save_max=%d): removed iteration %d", self.config.checkpoint.save_max, step)
