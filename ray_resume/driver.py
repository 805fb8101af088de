"""Every job's driver, `ray_resume.fit`'s and the built-in one's: the writer lease, the resume
source resolved once under it, the job's controller, the ranks (through a backend), the result.

    launch(cfg, train_func, loop_config, check=..., backend=RayTrain())

takes the lease on save_path before anything under it is read for
writing, resolves what to resume (`preflight.resolve_source`), runs the
job's own checks on it (`check`), then hands the job to a `Backend`: Ray
Train (`ray_backend.RayTrain`: a TorchTrainer and its restarts, the
controller a Ray actor on this node), local processes in the tests
(tests/harness.py's `LocalBackend`), in the same order. The controller's
account becomes a `Result`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol

import ray
import ray.train

from .checkpoint.format import paths
from .checkpoint.root import ResumePlan, ResumeSource, root_for
from .checkpoint.format.schema import Iteration
from .checkpoint.io.object_store import s3_filesystem
from .config import Config
from .errors import CommitError
from .faults import Fault
from .metrics import read_metrics
from .preflight import resolve_source
from .controller.job import JobOutcome
from .rank import RankLaunch
from .summary import summarize

logger = logging.getLogger("ray_resume")


class Backend(Protocol):
    """What runs a job's ranks to the end: the job's controller started with `plan` (the first
    start's), every rank handed `launch` beside the loop's own config; the controller's account."""

    def run(self, cfg: Config, plan: ResumePlan, launch: RankLaunch, loop_config: dict) -> JobOutcome: ...


class TrainingFailed(ray.train.TrainingFailedError):
    """The run failed and Ray Train's restarts could not save it (or a commit failed): what was
    committed stays, and the message says why in one line. The error underneath is `__cause__`;
    `worker_failures` maps each rank that failed to its own exception, as Ray Train's
    WorkerGroupError does (empty where no rank failed: a commit, the controller)."""

    def __init__(self, message: str, worker_failures: dict[int, BaseException] | None = None):
        super().__init__(message)
        self.worker_failures = dict(worker_failures or {})

    def __reduce__(self):
        return (self.__class__, (str(self), self.worker_failures))


@dataclass
class Result(ray.train.Result):
    """What `fit` and `train` return, as Ray Train's Result: `metrics` (rank 0's last step), `checkpoint`
    (the newest iteration this job committed, a `ray.train.Checkpoint`; None if none), `path` (the
    checkpoint root) and `error` (None: a failure raises); `committed_iteration` its step."""

    committed_iteration: int | None = None

    @property
    def checkpoint_path(self) -> str | None:
        """The committed iteration's directory as save_path names it (s3://... on object storage)."""
        return (
            paths.iteration_dir(self.path, self.committed_iteration) if self.committed_iteration is not None else None
        )


def ray_checkpoint(uri: str, storage) -> ray.train.Checkpoint:
    """Ray Train's Checkpoint of an iteration directory, with the filesystem of checkpoint.storage (an s3://
    URI alone would send Ray to AWS itself, not to the configured endpoint)."""
    if not paths.on_object_storage(uri):
        return ray.train.Checkpoint(paths.local_path(uri))
    return ray.train.Checkpoint(uri.split("://", 1)[1], filesystem=s3_filesystem(storage))


def launch(
    cfg: Config,
    train_func: Callable[[dict], None],
    loop_config: dict,
    *,
    check: Callable[[Config, ResumeSource | None, Iteration | None], Config],
    backend: Backend,
    summary: bool = True,
    fault: Fault | None = None,
) -> Result:
    """Run `train_func(loop_config)` on every rank to the end (with restarts), as described above; the
    Result, its `error` set (not raised) when the run failed. `fault`: one to inject (faults.py), for
    the tests and the quickstart's drill."""
    for line in cfg.failure.retired():
        logger.warning("[%s] %s", cfg.name, line)
    job_id = uuid.uuid4().hex[:12]
    clock = {"launched": time.time()}  # the first start's stamps (summary.start_clock); the backend adds its own
    ckpt = cfg.checkpoint
    lease = root_for(ckpt.save_path, ckpt.storage).lease(job_id, ckpt.lease_ttl_s) if ckpt.enable_save else None
    if lease:  # before anything under save_path is read for writing or moved
        lease.acquire()
        lease.keep_renewed()  # from this moment to the job's end
    try:
        source, it = resolve_source(cfg)
        cfg = check(cfg, source, it)
        clock["checked"] = time.time()
        # the first start's; the controller decides the restarts'
        plan = ResumePlan.first(source, cfg.checkpoint.no_load_optim)
        outcome = backend.run(cfg, plan, RankLaunch(train_func, job_id, clock, fault=fault), loop_config)
    finally:
        if lease:
            lease.release()
    if summary:
        say_summary(cfg, job_id, outcome.attempts, outcome.wall_s)
    committed = outcome.committed
    path = paths.iteration_dir(ckpt.save_path, committed) if committed is not None else None
    error = outcome.failure
    if outcome.user_error:  # what Ray Train's error wraps, in our words and of its class (it was not retried)
        error = outcome.user_error.error()
    elif outcome.commit_error:
        error = TrainingFailed(f"training failed: {outcome.commit_error}")
        error.__cause__ = CommitError(outcome.commit_error)
    elif error is not None:
        ranks = getattr(error, "worker_failures", None) or {}
        if ranks:  # Ray Train's WorkerGroupError: each rank's own exception, the first said
            for rank, exc in ranks.items():  # its traceback, as rank.run_rank took it
                if isinstance(getattr(exc, "rank_traceback", None), str):
                    exc.add_note(f"rank {rank}'s traceback:\n{exc.rank_traceback.rstrip()}")
            rank, exc = min(ranks.items(), key=lambda item: item[0])
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            reason = f"rank {rank}: {type(exc).__name__}: {first}" + (
                f" (and {len(ranks) - 1} more)" if len(ranks) > 1 else ""
            )
        elif missing := re.search(r"No module named '([^']+)'", str(error)):
            # Ray could not unpickle what a rank runs: the user's module is not there
            reason = (
                f"the workers could not import module '{missing[1]}' (the train function's, or one it needs); "
                "send it with the runtime env's working_dir or py_modules (RunConfig.worker_runtime_env, "
                "or ray.init(runtime_env=...))"
            )
        else:
            reason = next(
                (line for line in str(error).splitlines()[1:] + str(error).splitlines() if line.strip()),
                type(error).__name__,
            )
        failed = TrainingFailed(f"training failed: {reason.strip()}", ranks)
        failed.__cause__ = error
        error = failed
    if error is None and outcome.metrics.get("stopped"):
        logger.warning(
            "[%s] stopped at step %s on request: committed iteration %s; run again with "
            "checkpoint.load_path=%s to continue",
            cfg.name,
            outcome.metrics["step"],
            committed,
            ckpt.save_path,
        )
    elif error is None:
        logger.info("[%s] finished: last committed iteration %s%s", cfg.name, committed, f" at {path}" if path else "")
    if path and summary:
        logger.info(
            "[%s] to continue it: --set checkpoint.load_path=%s; to export its weights: ray-resume export %s OUT_DIR",
            cfg.name,
            ckpt.save_path,
            ckpt.save_path,
        )
    return Result(
        metrics=outcome.metrics,
        checkpoint=ray_checkpoint(path, ckpt.storage) if path else None,
        error=error,
        path=ckpt.save_path,
        committed_iteration=committed,
    )


def say_summary(cfg: Config, job_id: str, attempts: list[dict], wall_s: float) -> None:
    """The run's summary lines, from its metrics beside the checkpoint root (none without saves)."""
    if not cfg.checkpoint.enable_save:
        return
    try:
        records = read_metrics(cfg.checkpoint.save_path, cfg.checkpoint.storage)
    except OSError as exc:
        logger.warning("[%s] no summary: the metrics could not be read (%s)", cfg.name, exc)
        return
    for line in summarize(
        records, attempts, job_id=job_id, global_batch_size=cfg.training.global_batch_size, wall_s=wall_s
    ):
        logger.info("[%s] %s", cfg.name, line)


@contextlib.contextmanager
def stop_on_sigterm(request_stop: Callable[[], object], name: str):
    """SIGTERM (a preemption notice, `kill`, a scheduler's grace period) becomes a clean stop:
    `request_stop` asks the job's controller, the ranks save and commit at the next step boundary
    and the run returns."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return

    def on_sigterm(signum, frame):
        logger.warning("[%s] SIGTERM: saving a checkpoint at the next step boundary, then stopping", name)
        request_stop()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
