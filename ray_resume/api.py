"""Checkpointing for your own Ray Train loop: `fit` on the driver, `get_checkpointer` on every rank.

    import ray_resume

    def train_func(config):                                # every rank, as Ray Train runs it
        ck = ray_resume.get_checkpointer()
        model = ray.train.torch.prepare_model(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        start = ck.restore(model, opt, extra={"sched": sched})   # start.step, start.consumed_samples, start.source
        for step in range(start.step + 1, total + 1):
            ...
            ck.maybe_save(step, consumed_samples=step * batch, force=step == total)

    result = ray_resume.fit(train_func, checkpoint={"save_path": "/ckpt", "load_path": "/ckpt"},
                            scaling={"num_workers": 2}, failure={"max_failures": 3}, train_loop_config={...})

`fit` does on the driver what `python -m ray_resume.run` does (the writer lease,
the checkpoint checks, the job's controller that commits, Ray Train's
restarts), around your function: both go through `run.launch`, and every
rank of either through `run_rank` (the built-in loop is a train_func too).
`checkpoint`, `scaling` and `failure` take
the YAML sections' keys, defaults and checks. A restart resumes from this
job's newest commit, the first start from `checkpoint.load_path`.

What is saved, in the layout of every other ray_resume checkpoint: the
model, the optimizer's whole state (every slot of any torch.optim
optimizer, resharded on load like the model; and every param group's
hyperparameters, so an LR scheduler's changes come back), each rank's RNG
streams (torch, numpy, python, CUDA), and `extra`: objects with
`state_dict()` / `load_state_dict()` (LR schedulers, counters) or
`torch.Generator`s, per rank. Their tensors go to a safetensors blob and
everything else to JSON, both in the rank's optimizer shard header (so
keep them small: big state belongs in the model); a value that is neither
is refused, naming its key path. On another world size every rank gets
rank 0's param groups and extra state, and its RNG streams are not restored
(each rank keeps the ones it has). With `checkpoint.memory_interleaved_steps`,
`maybe_save` also snapshots all of it into memory between saves, and a restart
of the same size resumes from there (ray_resume.checkpoint.memory).
"""

from __future__ import annotations

import base64
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import safetensors.torch
import torch
import torch.distributed as dist

from .calls import call
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.loader import collective_device
from .checkpoint.schema import CheckpointError
from .checkpoint.state import class_path, load_optim_tensors, optim_tensors, unwrap
from .config import Config, ConfigError
from .data import DataError
from .faults import FaultInjector

INTERNAL = "_ray_resume"  # the key of our part of train_loop_config
MAX_EXTRA = 16 << 20  # bytes of JSON extra state per rank (it shares a 64 MiB safetensors header with the RNG)
_current: "RankCheckpointer | None" = None


@dataclass(frozen=True)
class Start:
    """Where your loop continues: the next step is `step + 1`."""

    step: int = 0
    consumed_samples: int = 0
    source: str | None = None  # the iteration (or export) loaded; None for a fresh start
    bytes_read: int = 0  # bytes this rank read from storage for it


def fit(train_func: Callable[[dict], None], *, checkpoint: dict, scaling: dict | None = None, failure: dict | None = None,
        train_loop_config: dict | None = None, name: str = "fit", address: str | None = None, verbose: bool = False):
    """Run `train_func(train_loop_config)` on every rank with ray_resume's checkpointing; a RunResult
    (`committed_iteration`, `checkpoint_path`, `error`). Bad keys are refused here, before Ray starts."""
    from .run import absolute_paths, find_resume, launch

    workers = (scaling or {}).get("num_workers", 2)
    sizes = range(workers[0], workers[1] + 1) if isinstance(workers, list) and len(workers) == 2 else [workers]
    whole = math.lcm(*sizes) if all(isinstance(n, int) and n > 0 for n in sizes) else 1
    cfg = absolute_paths(Config.from_dict({
        "name": name, "checkpoint": checkpoint, "scaling": scaling or {}, "failure": failure or {},
        # The built-in loop's keys: your loop has its own batches and steps (a batch size every world size divides).
        "training": {"global_batch_size": whole, "micro_batch_size": 1, "train_steps": 2**62},
    }, source="ray_resume.fit"))
    return launch(cfg, train_func, train_loop_config or {}, check=lambda: find_resume(cfg)[0], address=address,
                  verbose=verbose, summary=False)


def get_checkpointer() -> "RankCheckpointer":
    """This rank's checkpointer, inside a `train_func` that `ray_resume.fit` runs."""
    if _current is None:
        raise RuntimeError("ray_resume.get_checkpointer() works inside a train_func run by ray_resume.fit()")
    return _current


@dataclass(frozen=True)
class RankJob:
    """This rank's part of the job, for this worker-group start (the built-in loop reads it)."""

    cfg: Config
    controller: Any  # the job's controller (ray_resume.controller), reached through `call`
    rank: int
    world: int
    job_id: str
    attempt: int  # worker-group starts before this one
    resume_step: int | None  # this job's newest commit, on a restart
    memory_step: int | None  # a newer step the memory tier holds for every rank, on a restart
    ended: dict  # how the previous attempt ended (rank 0 only): failed_after, lost, clock
    faults: FaultInjector


def rank_entry(loop_config: dict) -> None:
    """Ray Train's entry point on every rank, for every job (`fit`'s and the built-in one)."""
    import ray.train

    ours = loop_config[INTERNAL]
    controller = loop_config["controller"]
    yours = {k: v for k, v in loop_config.items() if k not in (INTERNAL, "controller")}
    cfg = Config.from_dict(call(controller, "job_config"))  # the train_loop_config Ray Train shows is redacted
    ctx = ray.train.get_context()
    run_rank(cfg, controller, ctx.get_world_rank(), ctx.get_world_size(), ours["train_func"], yours,
             load=ours["load"], job_id=ours["job_id"])


def run_rank(cfg: Config, controller, rank: int, world: int, train_func: Callable[[dict], None], config: dict, *,
             load, job_id: str) -> None:
    """One rank of a job in an initialised process group: `train_func(config)` with this rank's
    RankCheckpointer, for this worker-group start. A user's mistake is said once and never retried:
    its rank reports it, and the group Ray Train restarts for it returns at once (JobController.user_failed)."""
    global _current
    attempt, resume_step, memory_step, ended = _agree_on_attempt(controller, rank, world, collective_device())
    if ended.pop("user_error"):
        return
    faults = FaultInjector(cfg.fault, rank, lambda: call(controller, "claim_fault"))
    _current = RankCheckpointer(RankJob(cfg, controller, rank, world, job_id, attempt, resume_step, memory_step, ended, faults), load)
    try:
        train_func(config)
        _current.finish()
    except (ConfigError, CheckpointError, DataError) as exc:
        call(controller, "user_failed", rank, str(exc))
        raise
    finally:
        _current = None


def _agree_on_attempt(controller, rank: int, world: int, device) -> tuple[int, int | None, int | None, dict]:
    """Rank 0 asks the driver; every rank gets the same attempt, step to resume (None: none), memory
    snapshot step to resume (None: none) and `user_error` (a rank found a mistake of the user's: the
    job is over). Rank 0 also learns how the previous attempt ended: `failed_after` (its last
    finished step) and `lost` (rank -> why)."""
    facts = torch.tensor([-1, -1, -1, 0], device=device)
    ended = {}
    if rank == 0:
        reply = call(controller, "start_attempt", world, process_started())
        ended = {"failed_after": reply["failed_after"], "lost": reply["lost"], "clock": reply["clock"]}
        steps = [-1 if reply[k] is None else reply[k] for k in ("resume_step", "memory_step")]
        facts = torch.tensor([reply["attempt"], *steps, reply["user_error"] is not None], device=device)
    dist.broadcast(facts, src=0)
    attempt, step, memory_step, user_error = facts.tolist()
    return attempt, None if step < 0 else step, None if memory_step < 0 else memory_step, {**ended, "user_error": bool(user_error)}


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
    """`restore` once, then `maybe_save` every step; `finish` waits for the last save (fit calls it)."""

    def __init__(self, job: RankJob, load):
        self.job = job
        cfg = self._cfg = job.cfg
        self._checkpointer = Checkpointer(cfg, job.controller, job.rank, job.world, job.attempt, job.faults)
        # A restart within this job resumes its own newest commit; the first start, checkpoint.load_path.
        self._source = (cfg.checkpoint.save_path, job.resume_step) if job.resume_step is not None else load
        self._full = job.resume_step is not None or not cfg.checkpoint.no_load_optim  # its own commit: always all of it
        self._model = self._optimizer = None
        self._extra: dict[str, Any] = {}
        self.last_snapshot_step: int | None = None  # the step of the last memory snapshot

    def restore(self, model: torch.nn.Module, optimizer, extra: dict[str, Any] | None = None, *,
                global_batch_size: int | None = None) -> Start:
        """Load the model, the optimizer and `extra` (in place) from what this job resumes, if anything.

        With `global_batch_size`, a checkpoint saved with another one resumes at step
        consumed_samples // global_batch_size (the spec's scenario C; the data cursor stays at the
        consumed samples); without, at its saved step.
        """
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = OptimizerState(model, optimizer)
        # else the built-in mixed-precision optimizer (ray_resume.optim), whose hyperparameters are the config's
        self._model, self._optimizer, self._extra = model, optimizer, dict(extra or {})
        if self._extra and self._cfg.checkpoint.no_save_optim:
            raise ConfigError("extra state rides in the optimizer shards, which checkpoint.no_save_optim: true leaves out; "
                              "drop one of them")
        for key, obj in self._extra.items():
            if not (isinstance(obj, torch.Generator) or (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))):
                raise ConfigError(f"extra[{key!r}]: a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                                  "pass objects that have them, or torch.Generators")
        point = None
        if self.job.memory_step is not None:  # newer than the last commit, held for every rank of this world size
            point = self._checkpointer.restore_snapshot(model, optimizer, self.job.memory_step)
        if point is None:
            full = self._full and self._source is not None and self._source[1] is not None  # an export holds weights only
            point = self._checkpointer.restore(model, optimizer, self._source, full=full, global_batch_size=global_batch_size,
                                               rank0_extras=isinstance(optimizer, OptimizerState) or bool(self._extra))
        if "param_groups" in point.extras and isinstance(optimizer, OptimizerState):
            optimizer.load_groups(json.loads(point.extras["param_groups"]))
        if "extra" in point.extras:
            load_extra(self._extra, point.extras["extra"], where=point.source)
        return Start(point.global_step, point.consumed_samples, point.source, point.bytes_read)

    def maybe_save(self, step: int, *, consumed_samples: int = 0, global_batch_size: int | None = None, force: bool = False,
                   common: dict | None = None) -> bool:
        """Save at every `checkpoint.save_interleaved_steps` (or now, with `force`); True if it saved.
        Between saves, snapshot into memory every `checkpoint.memory_interleaved_steps`.
        `common`: more JSON fields for the iteration's common.json (the built-in loop's epoch and data)."""
        if self._model is None:
            raise RuntimeError("call restore(model, optimizer) before maybe_save()")
        checkpointer = self._checkpointer
        durable = checkpointer.should_save(step) or (force and self._cfg.checkpoint.enable_save)
        if not (durable or checkpointer.snapshot_due(step)):
            return False
        optimizer = self._optimizer
        extras = {}
        if isinstance(optimizer, OptimizerState):
            extras["param_groups"] = json.dumps(optimizer.groups())
        if self._extra:
            extras["extra"] = dump_extra(self._extra)
            if len(extras["extra"]) > MAX_EXTRA:
                raise ConfigError(f"extra state of {len(extras['extra']) >> 20} MiB (keys {sorted(self._extra)}): it rides in "
                                  f"a shard header, which holds {MAX_EXTRA >> 20} MiB; keep big tensors in the model or the optimizer")
        common = {"global_step": step, "global_batch_size": global_batch_size or self._cfg.training.global_batch_size,
                  "consumed_samples": consumed_samples, "epoch_num": 0, "step_num": step,
                  "optimizer": class_path(type(optimizer.optimizer)),
                  **(optimizer.scaler.state() if optimizer.scaler else {"loss_scale": 1.0}), **(common or {})}
        if not durable:
            checkpointer.snapshot(step, self._model, optimizer, common, extras)
            self.last_snapshot_step = step
            return False
        return checkpointer.maybe_save(step, self._model, optimizer, common, force=force, extras=extras)

    @property
    def last_stall_s(self) -> float | None:
        """How long the last save blocked this rank (None before the first)."""
        return self._checkpointer.last_stall_s

    def finish(self) -> float:
        """Wait for the save in flight; seconds blocked (raises a failed background save's error)."""
        return self._checkpointer.finish()


class OptimizerState:
    """Any torch.optim optimizer over the model's parameters, as the Checkpointer saves and loads one."""

    scaler = None  # no loss scaling of ours: a GradScaler of yours goes into `extra`

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        names = {id(p): n for n, p in unwrap(model).named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        unknown = [i for i, p in enumerate(params) if id(p) not in names]
        if unknown:
            raise ConfigError(f"optimizer parameter {unknown[0]} is not a parameter of the model; build the optimizer over "
                              "model.parameters() (after prepare_model or fully_shard)")
        self.optimizer = optimizer
        self.named = [(names[id(p)], p) for p in params]  # in the optimizer's order: its state is positional

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def named_main(self) -> list[tuple[str, torch.Tensor]]:
        return self.named

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return optim_tensors(self.named, self.optimizer)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_optim_tensors(self.named, self.optimizer, tensors)

    def reload_main_params_from_model(self) -> None:
        pass  # the model's parameters are the ones it steps

    def groups(self) -> list[dict]:
        """Every param group's hyperparameters (lr, momentum, betas...), as JSON values."""
        out = []
        for i, group in enumerate(self.optimizer.param_groups):
            values = {}
            for key, value in group.items():
                if key == "params":
                    continue
                if torch.is_tensor(value) and value.numel() == 1:
                    value = value.item()
                if not (value is None or isinstance(value, (bool, int, float, str))
                        or (isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value))):
                    raise ConfigError(f"optimizer.param_groups[{i}][{key!r}] is a {type(value).__name__}; only numbers, "
                                      "strings, bools, None and lists of them are checkpointed")
                values[key] = value
            out.append(values)
        return out

    def load_groups(self, saved: list[dict]) -> None:
        live = self.optimizer.param_groups
        if len(saved) != len(live):
            raise ConfigError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(live)}; build it as it was")
        for group, values in zip(live, saved):
            for key, value in values.items():
                old = group.get(key)
                if torch.is_tensor(old):
                    old.fill_(value)  # a tensor hyperparameter (capturable lr) stays a tensor
                else:
                    group[key] = tuple(value) if isinstance(old, tuple) else value


def dump_extra(extra: dict[str, Any]) -> str:
    """Each object's state (a torch.Generator's, or its state_dict()) as JSON, tensors in one safetensors blob."""
    tensors: dict[str, torch.Tensor] = {}
    states = {key: _encode(obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict(), f"extra[{key!r}]", tensors)
              for key, obj in extra.items()}
    blob = safetensors.torch.save(tensors) if tensors else b""
    return json.dumps({"state": states, "tensors": base64.b64encode(blob).decode()}, sort_keys=True)


def load_extra(extra: dict[str, Any], text: str, where: str | None) -> None:
    saved = json.loads(text)
    tensors = safetensors.torch.load(base64.b64decode(saved["tensors"])) if saved["tensors"] else {}
    missing = sorted(set(extra) - set(saved["state"]))
    if missing:
        raise ConfigError(f"{where}: holds no extra state {missing[0]!r} (it has {sorted(saved['state'])}); pass the keys it was saved with")
    for key, obj in extra.items():
        state = _decode(saved["state"][key], tensors)
        obj.set_state(state) if isinstance(obj, torch.Generator) else obj.load_state_dict(state)


def _encode(value, path: str, tensors: dict[str, torch.Tensor]):
    if torch.is_tensor(value):
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, dict):
        return {"__items__": [[_encode(k, f"{path} key", tensors), _encode(v, f"{path}[{k!r}]", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(f"{path} is a {type(value).__name__}; extra state may hold tensors, numbers, strings, bools, None, "
                      "and lists, tuples and dicts of them (no pickle)")


def _decode(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return value
