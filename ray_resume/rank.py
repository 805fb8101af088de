"""Every rank of every job: its entry point under Ray Train, and its RankCheckpointer.

`rank_entry` is what the TorchTrainer runs on each rank, for `ray_resume.fit`'s
jobs and the built-in one alike (the built-in loop is a train_func too): it
gets the attempt and its `ResumePlan` (rank 0 asks the controller, which
decides it, and broadcasts it), then runs the job's train_func with this
rank's `RankCheckpointer`, which carries the plan out and which the loop
gets from `get_checkpointer()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .checkpoint import memory
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.restore import Start
from .checkpoint.format.state import class_path
from .collectives import decided_by_rank0
from .config import Config
from .controller.client import ControllerClient
from .controller.job import AttemptStart
from .errors import USER_ERRORS, ConfigError, RankError
from .extra_state import MAX_EXTRA, OptimizerState, dump_extra, load_extra
from .faults import Fault, FaultInjector
from .summary import start_clock

logger = logging.getLogger("ray_resume")
INTERNAL = "ray_resume"  # train_loop_config as the TorchTrainer gets it: {INTERNAL: a RankLaunch, USER: the loop's own}
USER = "config"
_current: "RankCheckpointer | None" = None


def get_checkpointer() -> "RankCheckpointer":
    """This rank's checkpointer, inside a `train_func` that `ray_resume.fit` runs."""
    if _current is None:
        raise RuntimeError("ray_resume.get_checkpointer() works inside a train_func run by ray_resume.fit()")
    return _current


@dataclass(frozen=True)
class RankLaunch:
    """What the driver hands every rank of the job beside the loop's own config (Ray Train carries it
    in train_loop_config under INTERNAL): made by `driver.launch`, completed by the backend."""

    train_func: Callable[[dict], None]
    job_id: str
    clock: dict  # the first start's stamps so far (summary.start_clock): the backend adds its own, then sends it
    controller: Any = None  # the JobController actor's handle, once the backend started it
    fault: Fault | None = None  # the job's injected fault (tests, the quickstart's drill); None in production


@dataclass(frozen=True)
class RankJob:
    """This rank's part of the job, for this worker-group start (the built-in loop reads it)."""

    cfg: Config
    controller: ControllerClient  # the job's controller
    rank: int
    world: int
    job_id: str
    start: AttemptStart  # the attempt, and what it resumes (the same on every rank)
    faults: FaultInjector

    @property
    def attempt(self) -> int:
        return self.start.attempt

    @property
    def ended(self) -> dict:
        """How the previous attempt ended and what this start took, for rank 0's account of it."""
        s = self.start
        return {"failed_after": s.failed_after, "lost": s.lost, "clock": s.clock} if self.rank == 0 else {}


def rank_entry(loop_config: dict) -> None:
    """Ray Train's entry point on every rank, for every job (`fit`'s and the built-in one)."""
    import ray.train

    launch: RankLaunch = loop_config[INTERNAL]
    controller = ControllerClient(launch.controller)
    cfg = controller.job_config()  # the train_loop_config Ray Train shows is redacted
    ctx = ray.train.get_context()
    run_rank(
        cfg,
        controller,
        ctx.get_world_rank(),
        ctx.get_world_size(),
        launch.train_func,
        loop_config[USER],
        job_id=launch.job_id,
        driver_clock=launch.clock,
        fault=launch.fault,
    )


def run_rank(
    cfg: Config,
    controller: ControllerClient,
    rank: int,
    world: int,
    train_func: Callable[[dict], None],
    config: dict,
    *,
    job_id: str,
    driver_clock: dict | None = None,
    fault: Fault | None = None,
) -> None:
    """One rank of a job in an initialised process group: `train_func(config)` with this rank's
    RankCheckpointer, for this worker-group start. A user's mistake is said once and never retried:
    its rank reports it, and the group Ray Train restarts for it returns at once (JobController.user_failed)."""
    global _current
    start = decided_by_rank0(
        lambda: _start_attempt(controller, world, driver_clock).to_json(), rank, "start the attempt"
    )
    start = AttemptStart.from_json(start)
    if start.user_error is not None:
        return
    faults = FaultInjector(fault, rank, controller.claim_fault)
    _current = RankCheckpointer(RankJob(cfg, controller, rank, world, job_id, start, faults))
    try:
        train_func(config)
        _current.finish()
    except USER_ERRORS as exc:
        controller.user_failed(RankError.of(rank, exc))
        raise
    except Exception as exc:  # Ray Train hands the driver the exception without it: the driver makes it a note
        with contextlib.suppress(AttributeError):  # an exception class with __slots__ takes no attribute
            exc.rank_traceback = "".join(traceback.format_exception(exc))
        raise
    finally:
        _current = None


def _start_attempt(controller: ControllerClient, world: int, driver_clock: dict | None) -> AttemptStart:
    """Rank 0's: the controller's new attempt and what it resumes, with what this start took so far
    (`clock`; the first start's from the driver's stamps and this process's start)."""
    started = process_started()
    start = controller.start_attempt(world, started)
    if start.attempt == 0 and driver_clock:
        start = dataclasses.replace(start, clock=start_clock(driver_clock, started, time.time()))
    return start


def process_started() -> float | None:
    """When this process started, on time.time()'s clock (None where there is no /proc to say)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


class RankCheckpointer:
    """`restore` once, then `maybe_save` every step; `finish` commits the last step given and waits
    for the save in flight (`fit` calls it when your train_func returns)."""

    def __init__(self, job: RankJob):
        self.job = job
        cfg = self._cfg = job.cfg
        self._checkpointer = Checkpointer(cfg.checkpoint, job.controller, job.rank, job.world, job.attempt, job.faults)
        self._model = self._optimizer = None
        self._extra: dict[str, Any] = {}
        self._global_batch_size: int | None = None  # the loop's, once it says
        self._last: tuple[int, dict] | None = None  # the last step given to maybe_save, and what it said of it
        self._saved: int | None = None  # the last step saved
        self._finished = False
        self.last_snapshot_step: int | None = None  # the step of the last memory snapshot
        every = cfg.checkpoint.memory_interleaved_steps
        self._memory_every: int | None = None if every == "auto" else every  # auto: this group decides it
        self._step_times: list[float] = []  # until then, when each maybe_save came
        self._snapshot_warm = False  # a first snapshot was sent: the path to the node's keeper is up

    def restore(
        self,
        model: torch.nn.Module,
        optimizer,
        extra: dict[str, Any] | None = None,
        *,
        global_batch_size: int | None = None,
        step: int | None = None,
    ) -> Start:
        """Load the model, the optimizer and `extra` (in place) from what this job resumes, if anything.

        With `global_batch_size`, a checkpoint saved with another one resumes at step
        consumed_samples // global_batch_size (the spec's scenario C; the data cursor stays at the
        consumed samples); without, at its saved step. `step`: the step a DCP checkpoint was taken
        at, for one that does not say (no torchtitan `train_state.step`).
        """
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = OptimizerState(model, optimizer)
        # else the built-in mixed-precision optimizer (ray_resume.optim), whose hyperparameters are the config's
        self._model, self._optimizer, self._extra = model, optimizer, dict(extra or {})
        self._global_batch_size = global_batch_size or self._global_batch_size
        if self._extra and self._cfg.checkpoint.no_save_optim:
            raise ConfigError(
                "extra state rides in the optimizer shards, which checkpoint.no_save_optim: true leaves out; "
                "drop one of them"
            )
        for key, obj in self._extra.items():
            if not (
                isinstance(obj, torch.Generator) or (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))
            ):
                raise ConfigError(
                    f"extra[{key!r}]: a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                    "pass objects that have them, or torch.Generators"
                )
        plan, restored = self.job.start.plan, None
        if plan.memory_step is not None:  # newer than the last commit, held for every rank of this world size
            restored = self._checkpointer.restore_snapshot(model, optimizer, plan.memory_step)
        if restored is None:
            restored = self._checkpointer.restore(
                model,
                optimizer,
                plan.source,
                full=plan.full,
                global_batch_size=global_batch_size,
                rank0_extras=isinstance(optimizer, OptimizerState) or bool(self._extra),
                step=step,
            )
        start, extras = restored
        if "param_groups" in extras and isinstance(optimizer, OptimizerState):
            optimizer.load_groups(json.loads(extras["param_groups"]))
        if "extra" in extras:
            load_extra(self._extra, extras["extra"], where=start.source)
        self._saved = start.step if start.source else None
        return start

    def maybe_save(
        self,
        step: int,
        *,
        consumed_samples: int | None = None,
        global_batch_size: int | None = None,
        force: bool = False,
        common: dict | None = None,
    ) -> bool:
        """Save at every `checkpoint.save_interleaved_steps` (or now, with `force`, which every rank must
        give alike: a save is the group's); True if it saved. Between saves, snapshot into memory every `checkpoint.memory_interleaved_steps`.

        `consumed_samples` and `global_batch_size` go to common.json as your loop gives them (null if
        it never does); `common`: more of its fields (the built-in loop's epoch_num and step_num, data)."""
        if self._model is None:
            raise RuntimeError("call restore(model, optimizer) before maybe_save()")
        self._checkpointer.poll()  # a failed background save is raised at the next step, saving or not
        ckpt = self._cfg.checkpoint
        self._global_batch_size = global_batch_size or self._global_batch_size
        said = {"consumed_samples": consumed_samples, "common": common}
        self._last = (step, said)
        if self._memory_every is None:
            self._step_times.append(time.perf_counter())
        if self.saves_at(step) or (force and ckpt.enable_save):
            self._save(step, said, durable=True)
            return True
        if self._memory_every is None and len(self._step_times) >= memory.AUTO_AFTER:
            self._memory_every = self._auto_memory_interval(step, said)
        elif self._memory_every and step % self._memory_every == 0:
            self._save(step, said, durable=False)
        return False

    def _auto_memory_interval(self, step: int, said: dict) -> int | None:
        """`memory_interleaved_steps: auto`: a snapshot now, sent before training goes on; from the second
        (the first finds its node's keeper still starting), rank 0's interval for the whole group, from
        how long that snapshot took and the group's steps before the first (memory.auto_interval)."""
        job, ckpt = self.job, self._cfg.checkpoint
        began = time.perf_counter()
        share_bytes = self._save(step, said, durable=False)
        self._checkpointer.memory_sender.wait()
        if not self._snapshot_warm:
            self._snapshot_warm = True
            return None
        snapshot_s = time.perf_counter() - began
        times = self._step_times[1 : memory.AUTO_AFTER]  # the group's first step is its slowest
        step_s = (times[-1] - times[0]) / (len(times) - 1)
        every, why = decided_by_rank0(
            lambda: memory.auto_interval(
                snapshot_s,
                step_s,
                share_bytes,
                memory.ranks_on_node(job.world),
                memory.object_store_bytes(),
                ckpt.save_interleaved_steps if ckpt.enable_save else math.inf,
            ),
            job.rank,
            "decide the memory tier's interval",
        )
        if job.rank == 0:
            logger.info("[%s] memory tier (auto): %s", self._cfg.name, why)
        return every

    def saves_at(self, step: int) -> bool:
        """Whether `maybe_save(step)` writes a durable save without being forced."""
        ckpt = self._cfg.checkpoint
        return ckpt.enable_save and step % ckpt.save_interleaved_steps == 0

    def _save(self, step: int, said: dict, *, durable: bool) -> int | None:
        optimizer = self._optimizer
        extras = {}
        if isinstance(optimizer, OptimizerState):
            extras["param_groups"] = json.dumps(optimizer.groups())
        if self._extra:
            extras["extra"] = dump_extra(self._extra)
            if len(extras["extra"]) > MAX_EXTRA:
                raise ConfigError(
                    f"extra state of {len(extras['extra']) >> 20} MiB (keys {sorted(self._extra)}): it rides in "
                    f"a shard header, which holds {MAX_EXTRA >> 20} MiB; keep big tensors in the model or the optimizer"
                )
        common = {
            "global_step": step,
            "global_batch_size": self._global_batch_size,
            "consumed_samples": said["consumed_samples"],
            "epoch_num": None,
            "step_num": None,
            "optimizer": class_path(type(optimizer.optimizer)),
            **(optimizer.scaler.state() if optimizer.scaler else {"loss_scale": 1.0}),
            **(said["common"] or {}),
        }
        if durable:
            self._checkpointer.save(step, self._model, optimizer, common, extras=extras)
            self._saved = step
        else:
            self.last_snapshot_step = step
            return self._checkpointer.snapshot(step, self._model, optimizer, common, extras)

    def async_chosen_at(self, step: int) -> str | None:
        """`checkpoint.async_save: auto`'s verdict, in one line, if the save of `step` made it (the same on
        every rank: rank 0's)."""
        choice = self._checkpointer.choice
        return choice.why if choice is not None and choice.decided_at == step else None

    @property
    def last_stall_s(self) -> float | None:
        """How long the last save blocked this rank (None before the first)."""
        return self._checkpointer.last_stall_s

    def finish(self, *, save_last: bool = True) -> float:
        """Save the last step given to `maybe_save` if it was not saved (unless `save_last` is off), and
        wait for the save in flight; seconds blocked (raises a failed background save's error). Once."""
        if self._finished:
            return 0.0
        self._finished = True
        if save_last and self._cfg.checkpoint.enable_save and self._last is not None and self._last[0] != self._saved:
            self._save(*self._last, durable=True)
        return self._checkpointer.close()
