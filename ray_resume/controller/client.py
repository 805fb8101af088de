"""The job's controller as a rank reaches it: every call a rank makes, one typed method each.

Ranks hold a `ControllerClient` of the controller's handle (its Ray actor; in the tests' harness
the object itself, served from another process) and never name a method by a string. The
checkpoint core is handed the client (or a stand-in with the methods it calls), so it imports
nothing of the controller's. Methods are named by the class's function (`calls.call`).
"""

from __future__ import annotations

from typing import Any

from ..calls import Polled, call, tell
from ..checkpoint.format.manifest import Manifest
from ..errors import RankError
from ..checkpoint.keeper import MemoryKeeper, Snapshot
from ..config import Config
from .job import AttemptStart, JobController


class ControllerClient:
    def __init__(self, handle):
        self.handle = handle  # the JobController's Ray actor handle, or the object

    def job_config(self) -> Config:
        """The job's whole config, credentials included (Ray Train's run state holds a redacted copy)."""
        return self._typed(JobController.job_config, Config)

    def start_attempt(self, world: int, process_started: float | None) -> AttemptStart:
        """Rank 0's, once per worker-group start: the new attempt and what it resumes."""
        return self._typed(JobController.start_attempt, AttemptStart, world, process_started)

    def _typed(self, method, kind: type, *args):
        """`method`'s answer, checked to be the `kind` it answers with."""
        value = call(self.handle, method, *args)
        if not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise TypeError(
                f"the controller answered {method.__name__} with a {type(value).__name__}, not {article} {kind.__name__}"
            )
        return value

    def claim_fault(self) -> bool:
        return call(self.handle, JobController.claim_fault)

    def user_failed(self, error: RankError) -> None:
        call(self.handle, JobController.user_failed, error)

    def stepped(self, attempt: int, step: int) -> None:
        """Rank 0 finished `step` (not waited for)."""
        tell(self.handle, JobController.stepped, attempt, step)

    def record_final_metrics(self, metrics: dict) -> None:
        call(self.handle, JobController.record_final_metrics, metrics)

    def should_stop_polled(self) -> Polled:
        """`should_stop`'s answer (calls.SAVE_AND_STOP, STOP_NOW), asked in the background."""
        return Polled(self.handle, JobController.should_stop, 0)

    def last_committed_polled(self) -> Polled:
        """The newest iteration this job committed, asked in the background."""
        return Polled(self.handle, JobController.last_committed)

    def report(self, attempt: int, iteration: int, manifest: Manifest, common: dict) -> bool:
        """This rank's shards of `iteration` are durable; True if that completed a commit."""
        return call(self.handle, JobController.report, attempt, iteration, manifest, common)

    # the memory tier (checkpoint.memory)
    def keeper_for(self, node: str) -> Any:
        """`node`'s MemoryKeeper (the controller itself where there is none, in the tests' harness)."""
        return call(self.handle, JobController.keeper_for, node) or self.handle

    def keep_snapshot(self, keeper, step: int, rank: int, snapshot: Snapshot) -> None:
        call(keeper, MemoryKeeper.keep_snapshot, step, rank, snapshot)

    def snapshotted(self, step: int, rank: int, world: int, node: str) -> None:
        call(self.handle, JobController.snapshotted, step, rank, world, node)

    def snapshot_keepers(self, step: int, rank: int) -> list:
        """Where `rank`'s snapshot of `step` is: its node's keeper, then its replica's (None: the controller)."""
        return [keeper or self.handle for keeper in call(self.handle, JobController.snapshot_keepers, step, rank)]

    def snapshot_lost(self, step: int) -> None:
        call(self.handle, JobController.snapshot_lost, step)
