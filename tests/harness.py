"""The in-process harness: a whole job on real gloo ranks, without Ray.

`run_job(cfg)` does what `ray_resume.run` and Ray Train do, with plain
processes: the driver's checks (`preflight`), the lease and the job's
controller (the real `JobController`, served from a process of its own, as
the actor is from its own), then W rank processes in a gloo group, each
running the real `run_rank` and built-in `train_worker` -- restore, loop,
maybe save, the real RankCheckpointer, writer and commit. Only two parts are swapped:

* Ray Train's restarts: when a rank dies, the others are killed and a new
  group starts (a new attempt), up to `failure.max_failures` times;
* Ray Data's executor: `LocalStream` reads the very plan of `SampleStream`
  with its very read function, in the rank's own process (tests/test_data.py
  checks that Ray Data delivers exactly that order).

A job run here writes the same bytes as the same job on Ray Train
(tests/test_harness.py checks it against the Ray reference run), so every
fault phase, commit, retention, fallback and resharding case can be run in
seconds. Ranks are forked from a forkserver that has torch and ray_resume
imported already.
"""

from __future__ import annotations

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
from ray_resume import controller as controller_module
from ray_resume.checkpoint.lease import LEASE_DIR, Lease
from ray_resume.checkpoint.memory import MemoryKeeper
from ray_resume.checkpoint.storage import storage_for
from ray_resume.config import Config
from ray_resume.data import SampleStream, _read_unit_batch
from ray_resume.plugins import resolve
from ray_resume.run import absolute_paths, preflight, with_lanes
from ray_resume.api import get_checkpointer, run_rank
from ray_resume.train_loop import train_worker

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "ray_resume.train_loop", "harness"])


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn`, its processes forked from the preloaded forkserver (seconds faster each)."""
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


class LocalStream(SampleStream):
    """SampleStream's plan and read function, run in this process instead of by Ray Data."""

    def _execute(self, epoch: int, items):
        for item in items:
            yield _read_unit_batch({k: np.array([v]) for k, v in item.items()}, **self.read_args(epoch))


class DriverSide(controller_module.JobController, MemoryKeeper):
    """The job's controller with the driver's lease, in one process: the job's driver. It keeps
    the memory tier's snapshots too (Ray's keepers are one actor per node).

    A fault that kills the driver (`commit_before_tracker`, `retention_delete`)
    kills this process, and with it the lease holder, as on a real cluster.
    """

    def __init__(self, save_path: str, job_id: str, config: dict, storage_faults=None):
        if storage_faults:
            storage_faults_module.install(*storage_faults)
        ckpt = config["checkpoint"]
        self.driver_lease = None
        if ckpt["enable_save"]:
            self.driver_lease = Lease(storage_for(save_path, ckpt["storage"]), save_path, job_id, ckpt["lease_ttl_s"])
            self.driver_lease.acquire()
            self.driver_lease.keep_renewed()
        controller_module.JobController.__init__(self, save_path, job_id, config, driver_pid=os.getpid())
        MemoryKeeper.__init__(self)

    def release(self) -> None:
        super().release()
        if self.driver_lease:
            self.driver_lease.release()


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
        self.deletions.append({"step": step, "blocked_at_commit": started_at, "released_at_commit": self.last_committed()})
        super()._remove_iteration(step)

    def deletions_done(self) -> list[dict]:
        return self.deletions


class StolenLease(DriverSide):
    """Another job takes the writer lease over as this job starts committing iteration 8 (as after
    this job stalled past its ttl): the commit must write nothing and the run must end with it."""

    def _commit(self, iteration: int, manifests: list[dict], common: dict) -> None:
        if iteration == 8:
            thief = {"job_id": "thief", "host": "elsewhere", "pid": 1, "expires_at": time.time() + 3600}
            path = Path(self.root) / LEASE_DIR / f"{self.driver_lease.generation + 1:08d}.json"
            path.write_text(json.dumps(thief))
        super()._commit(iteration, manifests, common)


class LostSnapshots(DriverSide):
    """Rank 1's memory snapshots are gone when asked for, as when its node died with its keeper."""

    def snapshot(self, step: int, rank: int):
        return None if rank == 1 else super().snapshot(step, rank)


class Driver(BaseManager):
    pass


Driver.register("JobController", DriverSide)
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


def _rank(rank: int, world: int, init: str, cfg_dict: dict, controller, plugins, load, job_id: str, preempted, storage_faults) -> None:
    if storage_faults:
        storage_faults_module.install(*storage_faults)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    loop = lambda config: train_worker(get_checkpointer(), torch.device("cpu"), plugins, stream=LocalStream, preempted=preempted)
    run_rank(Config.from_dict(cfg_dict), controller, rank, world, loop, {}, load=load, job_id=job_id)
    dist.barrier()
    os._exit(0)  # not a teardown of the group under live DDP objects: that sometimes hangs at exit


def _run_group(world: int, tmp: Path, args: tuple, driver: Driver, timeout: float) -> str | None:
    """One worker group to its end; None if every rank finished, else why not. A dead rank ends the group."""
    init = f"file://{tmp / f'pg-{uuid.uuid4().hex}'}"
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


def never() -> bool:
    return False


def run_job(cfg_dict: dict, *, build_model=None, loss=None, collate=None, preempted=never, timeout: float = 120,
            controller: str = "JobController", inspect=None, storage_faults: tuple[list[dict], str] | None = None) -> Outcome:
    """Run a job to its end as `ray_resume.run.run` does, its ranks in a gloo group of this machine.

    `preempted()` stands in for Ray Train's preemption notice (`ray.train.get_preemption_info()`).
    `controller` names the controller class served (`Driver.register`); `inspect(controller)`
    is called once the job has ended, before the controller is released. `storage_faults`,
    (faults, record file), are injected into the ranks' and the controller's storage
    (tests/storage_faults.py), not into the driver's checks before the job.
    """
    cfg = with_lanes(absolute_paths(Config.from_dict(cfg_dict)))
    plugins = resolve(cfg, build_model=build_model, loss=loss, collate=collate)
    load = preflight(cfg, plugins)
    tmp = Path(tempfile.gettempdir())  # the groups' rendezvous files
    job_id = uuid.uuid4().hex[:12]
    driver = Driver(ctx=CTX)
    driver.start()
    try:
        controller = getattr(driver, controller)(cfg.checkpoint.save_path, job_id, cfg.to_dict(), storage_faults)
        args = (cfg.to_dict(), controller, plugins, load, job_id, preempted, storage_faults)
        attempts, error = 0, None
        for attempts in range(1, cfg.failure.max_failures + 2):
            error = _run_group(cfg.scaling.max_workers, tmp, args, driver, timeout)
            if error is None or error == "driver died":
                break
        if error == "driver died":
            return Outcome(None, attempts, True, error)
        result = controller.result()
        controller.release()
        if inspect:
            inspect(controller)
        return Outcome(result["committed"], attempts, False, result["user_error"] or error or result["error"], result["attempts"])
    finally:
        driver.shutdown()
