"""The in-process harness: a whole job on real gloo ranks, without Ray.

`run_job(cfg)` runs the job through the product's own driver (`ray_resume.api.train`
-> `driver.launch`: the lease, the checks, the resume source, then the ranks) with
`LocalBackend` in place of Ray Train: the job's controller (the real `JobController`,
served from a process of its own, as the actor is from its own), then W rank processes
in a gloo group, each running the real `run_rank` and built-in `train_worker` -- restore,
loop, maybe save, the real RankCheckpointer, writer and commit. Only two parts are swapped:

* Ray Train's restarts: when a rank dies, the others are killed and a new
  group starts (a new attempt), up to `failure.max_failures` times;
* Ray Data's executor: `LocalStream` reads the very plan of `SampleStream`
  with its very read function, in the rank's own process (tests/test_data.py
  checks that Ray Data delivers exactly that order).

A job run here writes the same bytes as the same job on Ray Train
(tests/test_harness.py checks it against the Ray reference run), so every
fault phase, commit, retention, fallback and resharding case can be run in
seconds. A fault that kills the driver kills the controller's process (the
lease, held by this process, is given back as `launch` ends, where a real
driver's would be taken over as dead). Ranks are forked from a forkserver
that has torch and ray_resume imported already.
"""

from __future__ import annotations

import functools
import dataclasses
import json
import multiprocessing as mp
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.managers import BaseManager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import storage_faults as storage_faults_module
from ray_resume import api
from ray_resume import controller as controller_module
from ray_resume.checkpoint.io.lease import LEASE_DIR
from ray_resume.checkpoint.keeper import MemoryKeeper
from ray_resume.config import Config
from ray_resume.controller.client import ControllerClient
from ray_resume.controller.job import JobOutcome
from ray_resume.data import ReadUnit, SampleStream
from ray_resume.data.stream import _read_unit_batch
from ray_resume.driver import TrainingFailed, stop_on_sigterm
from ray_resume.errors import USER_ERRORS
from ray_resume.rank import RankLaunch, get_checkpointer, run_rank
from ray_resume.train_loop import train_func as built_in_train_func
from ray_resume.train_loop import train_worker

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "ray_resume.train_loop", "harness"])


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn`, its processes forked from the preloaded forkserver (seconds faster each)."""
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


class LocalStream(SampleStream):
    """SampleStream's plan and read function, run in this process instead of by Ray Data."""

    def _read_workers_ready(self) -> bool:
        return True

    def _execute(self, epoch: int, items):
        for item in items:
            yield _read_unit_batch({k: np.array([v]) for k, v in item.items()}, **self.read_args(epoch))


class DriverSide(controller_module.JobController, MemoryKeeper):
    """The job's controller, in a process of its own, as the Ray actor is. It keeps the memory
    tier's snapshots too (Ray's keepers are one actor per node).

    A fault that kills the driver (`commit_before_tracker`, `retention_delete`) kills this
    process: the job's driver as far as the ranks and the commits are concerned.
    """

    def __init__(
        self, save_path: str, job_id: str, config: Config, plan=None, storage_faults=None, setup=None, fault=None
    ):
        _prepare(storage_faults, setup)
        controller_module.JobController.__init__(
            self, save_path, job_id, config, driver_pid=os.getpid(), first_plan=plan, fault=fault
        )
        MemoryKeeper.__init__(self)

    def claim_fault(self) -> bool:
        claimed = super().claim_fault()
        if claimed:
            self.fault_claimed_at = time.time()
        return claimed

    def fault_fired(self) -> float | None:
        """When the job's injected fault fired (its one claim was taken), None if it did not."""
        return getattr(self, "fault_claimed_at", None)


class CommitsFirst(DriverSide):
    """The job's fault fires only once an iteration below its step is committed (at most 60 s): a rank
    that dies while saving 8 finds 4 committed, however long the other ranks took to write 4. Without
    it the test races the writers (on a busy machine rank 1 reached 8 before rank 0 had reported 4)."""

    def claim_fault(self) -> bool:
        deadline = time.monotonic() + 60
        while not any(step < self.fault.step for step in self.committed_by_job) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().claim_fault()


class SlowRetention(DriverSide):
    """Retention's deletion blocks until this job has committed one more iteration or is ending
    (at most 60 s): a controller that made training wait on its deletions never gets that commit."""

    def __init__(self, *args):
        super().__init__(*args)
        self.deletions: list[dict] = []
        self.ending = False

    def release(self) -> None:
        self.ending = True
        super().release()

    def _remove_iteration(self, step: int) -> None:
        started_at = self.last_committed()
        deadline = time.monotonic() + 60
        while self.last_committed() == started_at and not self.ending and time.monotonic() < deadline:
            time.sleep(0.05)
        self.deletions.append(
            {"step": step, "blocked_at_commit": started_at, "released_at_commit": self.last_committed()}
        )
        super()._remove_iteration(step)

    def deletions_done(self) -> list[dict]:
        return self.deletions


class StolenLease(DriverSide):
    """Another job takes the writer lease over as this job starts committing iteration 8 (as after
    this job stalled past its ttl): the commit must write nothing and the run must end with it."""

    def _commit(self, iteration: int, manifests: list, common: dict) -> None:
        if iteration == 8:
            thief = {"job_id": "thief", "host": "elsewhere", "pid": 1, "expires_at": time.time() + 3600}
            lease_dir = Path(self.root) / LEASE_DIR
            newest = max(int(p.stem) for p in lease_dir.glob("*.json"))
            (lease_dir / f"{newest + 1:08d}.json").write_text(json.dumps(thief))
        super()._commit(iteration, manifests, common)


class LostSnapshots(CommitsFirst):
    """Rank 1's memory snapshots are gone when asked for, as when its node died with its keeper (and the
    fault waits for a commit below it: the restart's storage is that iteration)."""

    def snapshot(self, step: int, rank: int):
        return None if rank == 1 else super().snapshot(step, rank)


class Driver(BaseManager):
    pass


Driver.register("JobController", DriverSide)
Driver.register("CommitsFirst", CommitsFirst)
Driver.register("SlowRetention", SlowRetention)
Driver.register("StolenLease", StolenLease)
Driver.register("LostSnapshots", LostSnapshots)


@dataclass
class Outcome:
    committed: int | None  # the newest iteration the job committed
    attempts: int  # worker groups started
    driver_killed: bool  # the job's driver (the controller's process) died
    error: str | None  # why the job failed, if it did
    reached: list = ()  # the controller's account of each attempt: the last step rank 0 finished, and when


def _prepare(storage_faults, setup) -> None:
    """What a test injects into each process of a job (the controller's, every rank's) as it starts."""
    if storage_faults:
        storage_faults_module.install(*storage_faults)
    if setup:
        setup[0](*setup[1:])


def _rank(
    rank: int,
    world: int,
    init: str,
    cfg_dict: dict,
    controller,
    launch: RankLaunch,
    config: dict,
    preempted,
    storage_faults,
    setup,
) -> None:
    _prepare(storage_faults, setup)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    # its Ray parts swapped: the CPU, LocalStream, the harness's preemption notice
    train_func = launch.train_func
    if train_func is built_in_train_func:

        def train_func(config):
            train_worker(
                get_checkpointer(),
                torch.device("cpu"),
                config["plugins"],
                stream=LocalStream,
                preempted=preempted,
                units=[ReadUnit(*u) for u in config["units"]],
            )

    run_rank(
        Config.from_dict(cfg_dict),
        ControllerClient(controller),
        rank,
        world,
        train_func,
        config,
        job_id=launch.job_id,
        fault=launch.fault,
    )
    dist.barrier()
    os._exit(0)  # not a teardown of the group under live DDP objects: that sometimes hangs at exit


def _run_group(world: int, tmp: Path, args: tuple, driver: Driver, timeout: float) -> str | None:
    """One worker group to its end; None if every rank finished, else why not. A dead rank ends the group."""
    rendezvous = tmp / f"pg-{uuid.uuid4().hex}"
    init = f"file://{rendezvous}"
    procs = [CTX.Process(target=_rank, args=(rank, world, init, *args), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.exitcode for p in procs]
            if not driver._process.is_alive():
                return "driver died"
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return "rank {} exited with {}".format(*failed[0])
            if all(c == 0 for c in codes):
                return None
            if time.monotonic() > deadline:
                return f"worker group still running after {timeout:.0f} s"
            time.sleep(0.02)
    finally:
        for p in procs:  # as Ray Train ends a group: what still runs is killed
            p.kill()  # SIGKILL; nothing if it has exited meanwhile
            p.join()
        rendezvous.unlink(missing_ok=True)  # gloo leaves it behind when a rank is killed


DEAD = object()  # what a call to a dead controller's process returns


def _if_alive(driver: Driver, call):
    """`call()` to the controller's process; DEAD if that process is dead (a fault killed the driver)."""
    try:
        return call()
    except (EOFError, OSError):
        driver._process.join(timeout=5)  # a process killed this instant is not yet known to be dead
        if driver._process.is_alive():  # an error of the call's own
            raise
        return DEAD


def never() -> bool:
    return False


class LocalBackend:
    """driver.launch's backend for the harness: the controller in a process of its own, the ranks in
    gloo groups of this machine, a new group for each lost one (up to failure.max_failures times).

    `controller` names the controller class served (`Driver.register`); `inspect(controller)` is
    called once the job has ended, before the controller is released; `preempted()` stands in for
    Ray Train's preemption notice; `storage_faults`, (faults, record file), are injected into the
    ranks' and the controller's storage (tests/storage_faults.py), not into the driver's checks;
    `setup`, (function, *args), is called in each of those processes as it starts. SIGTERM to this
    process asks the job to stop, as it does the driver's (`driver.stop_on_sigterm`)."""

    def __init__(
        self,
        *,
        controller: str = "JobController",
        preempted=never,
        timeout: float = 120,
        inspect=None,
        storage_faults=None,
        setup=None,
    ):
        self.controller, self.preempted, self.timeout, self.inspect = controller, preempted, timeout, inspect
        self.storage_faults, self.setup = storage_faults, setup
        self.outcome: Outcome | None = None  # once the job has run
        self.driver_pid: int | None = None  # the controller's process, once started

    def run(self, cfg: Config, plan, launch: RankLaunch, loop_config: dict) -> JobOutcome:
        started = time.monotonic()
        driver = Driver(ctx=CTX)
        driver.start()
        self.driver_pid = driver._process.pid
        try:
            controller = getattr(driver, self.controller)(
                cfg.checkpoint.save_path,
                launch.job_id,
                cfg,
                plan,
                self.storage_faults,
                self.setup,
                launch.fault,
            )
            args = (
                cfg.to_dict(),
                controller,
                launch,
                loop_config,
                self.preempted,
                self.storage_faults,
                self.setup,
            )
            attempts, error, result = 0, None, None
            with stop_on_sigterm(functools.partial(_if_alive, driver, controller.request_stop), cfg.name):
                for attempts in range(1, cfg.failure.max_failures + 2):
                    error = _run_group(cfg.scaling.max_workers, Path(tempfile.gettempdir()), args, driver, self.timeout)
                    if error is None or error == "driver died":
                        break
            if error != "driver died":  # it may die as the ranks end, too
                result = _if_alive(driver, controller.result)
                released = _if_alive(driver, controller.release)
                inspected = _if_alive(driver, lambda: self.inspect(controller)) if self.inspect else None
                if any(answer is DEAD for answer in (result, released, inspected)):
                    error = "driver died"
            if error == "driver died":
                self.outcome = Outcome(None, attempts, True, error)
                return JobOutcome(failure=RuntimeError(error), wall_s=time.monotonic() - started)
            self.outcome = Outcome(
                result.committed,
                attempts,
                False,
                result.user_error and str(result.user_error.error()) or error or result.commit_error,
                result.attempts,
            )
            return dataclasses.replace(
                result, failure=RuntimeError(error) if error else None, wall_s=time.monotonic() - started
            )
        finally:
            driver.shutdown()


def run_job(cfg_dict: dict, *, build_model=None, loss=None, collate=None, fault=None, **backend) -> Outcome:
    """Run a job to its end as `python -m ray_resume.run` does (`ray_resume.api.train`), its ranks in a
    gloo group of this machine (LocalBackend's keyword arguments in `backend`), `fault` (faults.Fault's
    fields) injected. A mistake the driver's checks find is raised, as it is by `train`; how the job
    ran is the Outcome."""
    local = LocalBackend(**backend)
    try:
        api.train(cfg_dict, build_model=build_model, loss=loss, collate=collate, backend=local, fault=fault)
    except (TrainingFailed, *USER_ERRORS):
        if local.outcome is None:  # found before the job ran
            raise
    return local.outcome
