"""The job's controller: attempts, commits, stop requests, faults and the lease (retention and the
memory tier's ledger are its mixins, in their own modules).

`JobController` lives on the driver's node as a Ray actor (the driver makes it one)
that outlives worker-group restarts (it is not part of the group), so it is
where a restarted group learns which iteration this job last committed.
Ranks send their manifest after their shards are durable; when all
`world_size` manifests of an iteration from the *current* attempt are in, it
commits them (`checkpoint.commit.commit_iteration`) and then applies
retention. Manifests from an older attempt are dropped: their rank may have
been killed mid-way and a new attempt is rewriting the same files.

Training never waits on a commit or a deletion: the actor is threaded, so
the per-step calls (`should_stop`, `last_committed`) are answered while a
commit runs, and retention deletes old iterations on a thread of its own
after the tracker has moved. What changes the job's state (an attempt
starting, a manifest arriving, a commit) is serialized by one lock, so a
commit and a restarted group asking "what is committed?" never interleave.

The class is plain Python; ranks reach it through `client.ControllerClient`, so the in-process
test harness serves the very same class without Ray.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from ..calls import SAVE_AND_STOP, STOP_NOW, serial
from ..errors import LeaseLost, RankError
from ..faults import Fault
from ..checkpoint.format import paths
from ..checkpoint.commit import commit_iteration
from ..checkpoint.format.manifest import Manifest
from ..checkpoint.root import ResumePlan, root_for
from ..config import Config, redacted
from ..summary import Reached, restart_clock
from .retention import Retention
from .snapshots import SnapshotLedger

logger = logging.getLogger("ray_resume.controller")


@dataclass(frozen=True)
class AttemptStart:
    """What a worker group is told as it starts (rank 0 asks, `start_attempt`; every rank gets it)."""

    attempt: int  # worker-group starts of this job before this one
    plan: ResumePlan  # what it resumes
    user_error: str | None = None  # a rank found a mistake of the user's: the job is over, this group returns at once
    failed_after: int | None = None  # the last step the previous attempt finished (None on the first, or before a step)
    lost: dict[str, str] = field(default_factory=dict)  # rank -> why, of the previous attempt (Ray Train's word)
    clock: dict = field(default_factory=dict)  # what this start took so far (summary.restart_clock)

    def to_json(self) -> dict:
        return {**asdict(self), "plan": self.plan.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "AttemptStart":
        return cls(**{**data, "plan": ResumePlan.from_json(data["plan"])})


@dataclass(frozen=True)
class JobOutcome:
    """How a job ran: the controller's account (`JobController.result`), and the backend's (`failure`, `wall_s`)."""

    committed: int | None = None  # the newest iteration this job committed
    metrics: dict = field(default_factory=dict)  # rank 0's last step's
    commit_error: str | None = None  # a commit failed: why, and where the tracker stays
    # per worker-group start: the last step rank 0 finished, and when
    attempts: list[Reached] = field(default_factory=list)
    user_error: RankError | None = None  # a mistake of the user's a rank found (the job ended with it)
    failure: BaseException | None = None  # what the backend's run raised (Ray Train's error)
    wall_s: float = 0.0  # the run's wall time


class JobController(SnapshotLedger, Retention):
    def __init__(
        self,
        save_path: str,
        job_id: str,
        config: Config,
        driver_pid: int,
        keepers: dict | None = None,
        first_plan: ResumePlan | None = None,
        fault: Fault | None = None,
    ):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        self.root = save_path
        self.job_id = job_id
        self.config = config
        self.driver_pid = driver_pid
        self.fault = fault  # the job's injected fault (tests, the quickstart's drill); None in production
        self.checkpoint_root = root_for(save_path, config.checkpoint.storage) if save_path else None
        self.storage = self.checkpoint_root.storage if save_path else None
        self.first_plan = first_plan or ResumePlan()  # the driver's, for the first start (and restarts before a commit)
        self.attempt = -1
        self.reached: list[Reached] = []  # per attempt: the last step rank 0 finished, and when
        self.lost: dict[int, str] = {}  # rank -> why, for the current attempt's failure (Ray Train tells us)
        self.noticed_at: float | None = None  # when Ray Train told us (time.time(), this process's clock)
        self.pending: dict[int, dict[int, Manifest]] = {}  # iteration -> rank -> manifest
        self.pending_common: dict[int, dict] = {}  # iteration -> rank 0's common
        self.committed_by_job: list[int] = []
        self.complete_below: set[int] = set()  # iterations retention found complete (it clears the others)
        self.failed_commits: set[int] = set()  # iterations this job wrote but did not commit (retention clears them)
        self.fault_claimed = False
        self.final_metrics: dict = {}
        self.stop_requested = False
        self.commit_error: str | None = None  # the first failed commit, for the driver's result
        self.user_error: RankError | None = None  # the first mistake of the user's a rank found: the job ends with it
        self.lease_lost = False  # a commit found another job holding the writer lease
        SnapshotLedger.__init__(self, keepers)  # the memory tier (checkpoint.memory_interleaved_steps)
        self.lock = threading.RLock()  # attempts, manifests and commits, one at a time (a commit claims its fault)
        self.deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")  # in commit order
        self.lease = None
        if self.storage and config.checkpoint.enable_save:
            # The driver took the lease and renews it; every commit checks this job still holds it.
            self.lease = self.checkpoint_root.lease(job_id, config.checkpoint.lease_ttl_s)

    def job_config(self) -> Config:
        """The job's whole config, credentials included (Ray Train's run state holds a redacted copy)."""
        return self.config

    @serial
    def start_attempt(self, world: int, process_started: float | None = None) -> AttemptStart:
        """Called once per worker-group start by rank 0: a new attempt, and what it resumes."""
        with self.lock:
            return self._start_attempt(world, process_started)

    def _start_attempt(self, world: int, process_started: float | None) -> AttemptStart:
        """The one place a restart's resume is decided (the first start's is the driver's): this job's
        newest commit, and a newer step the memory tier holds for every rank of a group of this
        `world` size. `process_started`: when rank 0's process started (None: unknown), which splits
        the new group's time in two."""
        self.attempt += 1
        self.pending.clear()
        self.pending_common.clear()
        failed_after = self.reached[-1].step if self.reached else None
        lost, self.lost = self.lost, {}
        now, last = time.time(), self.reached[-1].time if self.reached else None
        noticed, self.noticed_at = self.noticed_at, None
        clock = {} if last is None else restart_clock(last, noticed, process_started, now)
        self.reached.append(Reached(self.attempt))
        plan = (
            self.first_plan
            if self.attempt == 0
            else self.first_plan.restart(self.root, self.last_committed(), self.memory_step(world))
        )
        return AttemptStart(
            self.attempt,
            plan,
            self.user_error and self.user_error.message,
            failed_after,
            {str(rank): why for rank, why in sorted(lost.items())},
            clock,
        )

    @serial
    def user_failed(self, error: RankError) -> None:
        """A rank hit a mistake of the user's (a loss that is not a scalar...): running it again would
        hit it again, so the group Ray Train restarts for it returns at once and the run ends with it,
        raised to the caller as the rank raised it (its class, problems and traceback)."""
        if not isinstance(error, RankError):
            raise TypeError(f"user_failed takes a RankError, not a {type(error).__name__}")
        if self.user_error is None:
            self.user_error = error

    def ranks_failed(self, why: dict[int, str]) -> None:
        """Ray Train saw these ranks fail (rank -> its error's first line): the restart names them."""
        self.lost.update(why)
        self.noticed_at = self.noticed_at or time.time()

    def stepped(self, attempt: int, step: int) -> None:
        """Rank 0 finished `step` of `attempt`: what a restart says the lost attempt had reached."""
        if attempt == self.attempt:
            self.reached[-1] = Reached(attempt, step, time.time())

    @serial
    def claim_fault(self) -> bool:
        """True exactly once per job: the injected fault fires a single time."""
        with self.lock:
            claimed, self.fault_claimed = self.fault_claimed, True
        return not claimed

    def request_stop(self) -> None:
        """Preemption: the ranks save at the next step boundary and end the run cleanly."""
        self.stop_requested = True

    def should_stop(self) -> int:
        """What the ranks do at the next step boundary: 0 go on; SAVE_AND_STOP (a stop was
        requested, or a commit failed: never silently, and one more save may commit where it
        failed); STOP_NOW (this job lost the writer lease: a save would write into a root
        another job now owns)."""
        if self.lease_lost:
            return STOP_NOW
        return SAVE_AND_STOP if self.stop_requested or self.commit_error is not None else 0

    def release(self) -> None:
        """The job is over: finish retention's deletions, clear what was never committed below the tracker
        (a job with nothing left to do commits nothing), and the driver gives the lease back after this."""
        if self.lease is not None and not self.lease_lost:
            self.clear_below_tracker()
        self.deleter.shutdown(wait=True)

    def record_final_metrics(self, metrics: dict) -> None:
        """Rank 0's last step metrics, for the driver's result."""
        self.final_metrics = metrics

    def result(self) -> JobOutcome:
        """What the job committed, rank 0's last metrics, and why the run failed if a commit did."""
        error = None
        if self.commit_error:
            last = self.last_committed()
            where = f"iteration {last}, the last good commit" if last is not None else "what it named before"
            error = f"{self.commit_error}; the tracker of {self.root} stays on {where}; run again with checkpoint.load_path={self.root} to resume from it"
        return JobOutcome(self.last_committed(), self.final_metrics, error, self.reached, self.user_error)

    def last_committed(self) -> int | None:
        return self.committed_by_job[-1] if self.committed_by_job else None

    @serial
    def report(self, attempt: int, iteration: int, manifest: Manifest, common: dict) -> bool:
        """A rank's shards of `iteration` are durable. Returns True if this completed a commit.

        Only what the commit needs is held: each rank's manifest, and rank 0's
        `common` (the ranks' copies are the same).
        """
        with self.lock:
            return self._report(attempt, iteration, manifest, common)

    def _report(self, attempt: int, iteration: int, manifest: Manifest, common: dict) -> bool:
        if attempt != self.attempt:
            logger.info(
                "ignoring a manifest of iteration %d from attempt %d (now %d)", iteration, attempt, self.attempt
            )
            return False
        got = self.pending.setdefault(iteration, {})
        got[manifest.rank] = manifest
        if manifest.rank == 0:
            self.pending_common[iteration] = common
        if len(got) < manifest.world_size:
            return False
        del self.pending[iteration]
        common = self.pending_common.pop(iteration, None)
        try:
            if common is None or sorted(got) != list(range(len(got))):
                raise RuntimeError(
                    f"iteration {iteration}: manifests came from ranks {sorted(got)[:8]}..., not 0..{len(got) - 1}"
                )
            self._commit(iteration, [got[rank] for rank in range(len(got))], common)
            return True
        except Exception as exc:  # never raised into Ray: the ranks stop, and the driver fails the run with it
            logger.exception("commit of iteration %d failed; the tracker stays on the previous iteration", iteration)
            self.failed_commits.add(iteration)
            self.commit_error = self.commit_error or f"the commit of iteration {iteration} failed: {exc}"
            self.lease_lost = self.lease_lost or isinstance(exc, LeaseLost)
            return False

    def _commit(self, iteration: int, manifests: list[Manifest], common: dict) -> None:
        metadata = commit_iteration(
            self.storage,
            self.root,
            iteration,
            manifests,
            common,
            prefix=self.config.checkpoint.prefix,
            config=redacted(self.config.to_dict()),
            job_id=self.job_id,
            fence=self.lease.check if self.lease else lambda: None,
            before_tracker=lambda: self._before_tracker(iteration),
        )
        self.committed_by_job.append(iteration)
        self.failed_commits.discard(iteration)  # saved again, committed this time
        logger.info(
            "committed iteration %d (%d shards) at %s",
            iteration,
            len(metadata["ray_resume"]["files"]),
            paths.iteration_dir(self.root, iteration),
        )
        self._apply_retention(iteration)

    def _before_tracker(self, iteration: int) -> None:
        """Fault injection between the JSON files and the tracker: the driver dies, or the write fails."""
        f = self.fault
        if f and (f.at("commit_before_tracker", iteration) or f.at("commit_fails", iteration)) and self.claim_fault():
            if f.phase == "commit_fails":
                raise OSError(errno.EIO, f"injected fault: the tracker write for iteration {iteration} failed")
            self._kill_driver(f"before moving the tracker to {iteration}")

    def _kill_driver(self, when: str) -> None:
        # The whole job dies, as when the head node is lost: the driver and this actor with it.
        print(f"[fault] killing the driver (pid {self.driver_pid}) {when}", flush=True)
        os.kill(self.driver_pid, signal.SIGKILL)
        os._exit(1)
