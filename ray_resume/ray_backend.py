"""The ranks as Ray Train runs them (`RayTrain`, the backend `driver.launch` hands a job to, for `fit`
and the built-in job): a TorchTrainer of `rank.rank_entry` with Ray Train's restarts, the job's
controller a Ray actor on the driver's node, a memory keeper on every node; and the local Ray a
laptop's job starts by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import socket
import time
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .calls import call, tell
from .checkpoint.keeper import MemoryKeeper
from .checkpoint.root import ResumePlan
from .config import Config, ScalingConfig
from .controller import JobController
from .controller.job import JobOutcome
from .driver import stop_on_sigterm
from .rank import INTERNAL, USER, RankLaunch, rank_entry

logger = logging.getLogger("ray_resume")

CONTROLLER_NAME = "ray_resume.controller."  # + the job id: each job's controller is a named actor
# Threaded: the per-step calls of every rank are answered while a commit runs (see calls.serial).
JobControllerActor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=16, concurrency_groups={"state": 1})(
    JobController
)


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
            cfg.checkpoint.save_path, job_id, cfg, os.getpid(), keepers, plan, launch.fault
        )
        ring = list(keepers.values())
        for i, keeper in enumerate(ring):  # not waited for: they start beside the first group (MemoryKeeper.attached)
            tell(keeper, MemoryKeeper.attach, controller, ring[(i + 1) % len(ring)] if len(ring) > 1 else None)
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
            with stop_on_sigterm(functools.partial(tell, controller, JobController.request_stop), cfg.name):
                trainer.fit()
        except Exception as exc:  # Ray wraps worker errors; report them, keep what was committed
            failure = exc
        wall_s = time.monotonic() - started
        outcome = call(controller, JobController.result)
        call(controller, JobController.release)
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
        tell(self.controller, JobController.ranks_failed, why)


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
