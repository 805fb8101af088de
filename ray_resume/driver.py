"""Every job's driver, `ray_resume.fit`'s and the built-in one's: the writer lease, the resume
source resolved once under it, the job's controller, the ranks (through a backend), the result.

    launch(cfg, train_func, loop_config, check=..., backend=RayTrain())

takes the lease on save_path before anything under it is read for
writing, resolves what to resume (`preflight.resolve_source`), runs the
job's own checks on it (`check`), then hands the job to the backend: Ray
Train here (`RayTrain`: a TorchTrainer and its restarts, the controller a
Ray actor on this node), local processes in the tests (tests/harness.py),
in the same order. The controller's account becomes a `Result`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .checkpoint.format import paths
from .checkpoint.keeper import MemoryKeeper
from .checkpoint.root import ResumePlan, ResumeSource, root_for
from .checkpoint.format.schema import Iteration
from .checkpoint.io.object_store import s3_filesystem
from .config import Config, ScalingConfig
from .controller import JobController
from .controller.job import JobOutcome
from .errors import CommitError
from .faults import Fault
from .metrics import read_metrics
from .preflight import resolve_source
from .rank import INTERNAL, USER, RankLaunch, rank_entry
from .summary import summarize

logger = logging.getLogger("ray_resume")

CONTROLLER_NAME = "ray_resume.controller."  # + the job id: each job's controller is a named actor
# Threaded: the per-step calls of every rank are answered while a commit runs (see calls.SERIAL).
JobControllerActor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=16, concurrency_groups={"state": 1})(
    JobController
)


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
    backend,
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


class RayTrain:
    """The ranks as Ray Train runs them: a TorchTrainer of `rank.rank_entry` with Ray Train's restarts,
    the job's controller a Ray actor on the driver's node (and with the memory tier, a keeper on every node).

    `scaling_config` and `run_config` are Ray Train's own, as a user of `fit` gives them (else made
    from the config's sections); ours go beside theirs (our callback, our failure and logging settings)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        scaling_config: ray.train.ScalingConfig | None = None,
        run_config: ray.train.RunConfig | None = None,
        verbose: bool = False,
    ):
        self.address, self.scaling_config, self.run_config, self.verbose = address, scaling_config, run_config, verbose

    def run(self, cfg: Config, plan: ResumePlan, launch: RankLaunch, loop_config: dict) -> JobOutcome:
        """The job to its end: the controller's account, the failure `fit()` raised, and the wall time."""
        init_ray(self.address, cfg)
        scaling = self.scaling_config or scaling_config(cfg.scaling)
        job_id, clock = launch.job_id, launch.clock
        clock["ray_up"] = time.time()
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # On the driver's node: the commit must run where the driver does (it dies with it).
        keepers = start_keepers() if cfg.checkpoint.memory_interleaved_steps else {}
        controller = JobControllerActor.options(scheduling_strategy=here, name=f"{CONTROLLER_NAME}{job_id}").remote(
            cfg.checkpoint.save_path, job_id, cfg.to_dict(), os.getpid(), keepers, plan, launch.fault
        )
        ring = list(keepers.values())
        for i, keeper in enumerate(ring):  # not waited for: they start beside the first group (MemoryKeeper.attached)
            keeper.attach.remote(controller, ring[(i + 1) % len(ring)] if len(ring) > 1 else None)
        clock["fit"] = time.time()
        launch = dataclasses.replace(launch, controller=controller)
        trainer = TorchTrainer(
            rank_entry,
            train_loop_config={INTERNAL: launch, USER: loop_config},
            scaling_config=scaling,
            run_config=self._run_config(cfg, job_id, controller),
        )
        failure = None
        started = time.monotonic()
        # Read by Ray Train when fit() starts its controller (and handed on to it): a lost worker is
        # noticed within one interval, 2 s by Ray's default, 0.5 s by ours (a poll is one small call per worker).
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.failure.health_check_interval_s)
        try:
            with stop_on_sigterm(controller.request_stop.remote, cfg.name):
                trainer.fit()
        except Exception as exc:  # Ray wraps worker errors; report them, keep what was committed
            failure = exc
        wall_s = time.monotonic() - started
        outcome = ray.get(controller.result.remote())
        ray.get(controller.release.remote())
        for keeper in keepers.values():  # the job's snapshots go with it
            ray.kill(keeper)
        return dataclasses.replace(outcome, failure=failure, wall_s=wall_s)

    def _run_config(self, cfg: Config, job_id: str, controller) -> ray.train.RunConfig:
        yours = self.run_config or ray.train.RunConfig()
        return dataclasses.replace(
            yours,
            name=yours.name or f"{cfg.name}-{job_id}",
            failure_config=dataclasses.replace(
                yours.failure_config or ray.train.FailureConfig(), max_failures=cfg.failure.max_failures
            ),
            # Ray Train's own lines (worker-group starts, a recovered failure's 60-line
            # tracebacks, a surviving rank's "Error in training function") to its log files
            # only: a failure that ends the run raises from fit(), and is said in one line.
            # RunConfig() always holds a LoggingConfig: only one the user changed is theirs.
            logging_config=(
                yours.logging_config
                if yours.logging_config not in (None, ray.train.LoggingConfig())
                else ray.train.LoggingConfig(log_level="INFO" if self.verbose else "CRITICAL")
            ),
            callbacks=[*(yours.callbacks or []), FailedRanks(controller)],
        )


def scaling_config(scaling: ScalingConfig) -> ray.train.ScalingConfig:
    """Ray Train's ScalingConfig for the `scaling:` section (a [min, max] list makes it elastic)."""
    workers = scaling.num_workers
    return ray.train.ScalingConfig(
        num_workers=tuple(workers) if isinstance(workers, list) else workers,
        use_gpu=scaling.use_gpu,
        resources_per_worker=dict(scaling.resources_per_worker) or None,
        elastic_resize_monitor_interval_s=scaling.elastic_resize_interval_s,
    )


def start_keepers() -> dict:
    """A MemoryKeeper on every live node, owned by this driver: the memory tier's snapshots outlive
    the worker groups (a node that joins later sends its ranks' to another node's keeper). Each
    replicates its snapshots to the next one (attach, in RayTrain.run)."""
    actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(MemoryKeeper)
    return {
        node["NodeID"]: actor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(attaching=True)
        for node in ray.nodes()
        if node["Alive"]
    }


class FailedRanks(ray.train.UserCallback):
    """On Ray Train's controller: which ranks failed, and the first line of why, for the line a
    restarted group says (the full errors stay in Ray Train's log files)."""

    def __init__(self, controller: Any):
        self.controller = controller

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        why = {
            rank: (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            for rank, exc in worker_exceptions.items()
        }
        self.controller.ranks_failed.remote(why)


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


def init_ray(address: str | None, cfg: Config) -> None:
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # A state API server named for this cluster (see init_local_ray) reaches this job's processes too.
        api = os.environ.get("RAY_API_SERVER_ADDRESS")
        ray.init(address=address, **({"runtime_env": {"env_vars": {"RAY_API_SERVER_ADDRESS": api}}} if api else {}))
    else:
        # Room for the training workers plus the Ray Data read tasks beside them.
        init_local_ray(num_cpus=max(os.cpu_count() or 1, cfg.scaling.max_workers + 2))


def free_port() -> int:
    """A free loopback port between Ray's worker ports (10002-19999) and the kernel's ephemeral range,
    which no process is handed by bind(0): a port from bind(0) was taken by one of Ray's own
    processes before its dashboard bound it ("Failed to find a valid port for dashboard"), and the job
    waited 60 s to fail."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    for port in random.sample(range(20000, max(20001, ephemeral)), 50):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port between 20000 and the ephemeral range for Ray's dashboard")


def init_local_ray(**options) -> str:
    """Start a new Ray of our own (never a stale `ray start` cluster) with its dashboard on a
    free loopback port; returns the dashboard's URL.

    Ray Train v2's placement-group cleaner asks the state API, which the dashboard serves,
    whether the controller is alive, and `fit()` returns only once that call is done or 12 s
    have passed. Without a dashboard, or when the state API finds another Ray (the
    `/tmp/ray/ray_current_cluster` file a `ray start` leaves behind, a second Ray on the
    host), each call hangs 10-40 s: every job ended 12 s late and logged "Failed to query
    Ray Train Controller actor state". RAY_API_SERVER_ADDRESS sends the state API of every
    process of this job to our own dashboard.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(
        address="local",
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": url}},
        **options,
    )
    return url
