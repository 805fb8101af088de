"""Retention on the job's controller: keep the newest `save_max` iterations this job committed,
deleting older ones of this job only, crash-safe, on a thread of its own.

A mixin of `JobController` (the harness overrides `_remove_iteration` to slow it down).
"""

from __future__ import annotations

import logging

from ..checkpoint import paths

logger = logging.getLogger("ray_resume.controller")


class Retention:
    def _apply_retention(self, tracked: int) -> None:
        """Keep the newest `save_max` iterations this job committed; remove older ones of this job only.

        Runs after the tracker has moved (a failed deletion never costs the
        newest commit), on the deletion thread: a slow `rmtree` holds up
        neither the ranks nor the next commit. Iterations of earlier jobs
        under the same root, such as the one this job resumed from, are
        never in `committed_by_job`.
        """
        keep = self.config["checkpoint"]["save_max"]
        while len(self.committed_by_job) > keep:
            victim = self.committed_by_job.pop(0)
            if victim != tracked:
                self.deleter.submit(self._delete_iteration, victim)

    def _delete_iteration(self, step: int) -> None:
        """Crash-safe: common.json goes first, so a half-deleted dir can never pass as complete.
        A failed deletion costs disk, not the run: it is logged, and the iteration stays."""
        try:
            self._remove_iteration(step)
        except Exception:
            logger.exception("retention could not remove iteration %d; remove %s by hand", step, paths.iteration_dir(self.root, step))

    def _remove_iteration(self, step: int) -> None:
        iter_dir = paths.iteration_dir(self.root, step)
        self.storage.remove(paths.join(iter_dir, paths.COMMON))
        f = self.fault
        if f and f["phase"] == "retention_delete" and f["step"] == step and self.claim_fault():
            self._kill_driver(f"while deleting iteration {step}")
        self.storage.remove_tree(iter_dir)
        logger.info("retention (save_max=%d): removed iteration %d", self.config["checkpoint"]["save_max"], step)
