"""The public surface: `fit` for your own Ray Train loop, `train` for the built-in job, and
`get_checkpointer` on every rank.

    import ray.train, ray_resume

    def train_func(config):                                # every rank, as Ray Train runs it
        ck = ray_resume.get_checkpointer()
        model = ray.train.torch.prepare_model(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        start = ck.restore(model, opt, extra={"sched": sched})   # start.step, start.consumed_samples, start.source
        for step in range(start.step + 1, total + 1):
            ...
            ck.maybe_save(step, consumed_samples=step * batch, global_batch_size=batch)

    try:
        result = ray_resume.fit(train_func, checkpoint={"save_path": "/ckpt", "load_path": "/ckpt"},
                                scaling_config=ray.train.ScalingConfig(num_workers=2),
                                run_config=ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=3)),
                                train_loop_config={...})
    except ray.train.TrainingFailedError as exc:           # ray_resume.TrainingFailed, in one line
        ...
    result.checkpoint                                      # the newest committed iteration, a ray.train.Checkpoint

`fit` does on the driver what `python -m ray_resume.run` does (the writer
lease, the checkpoint checks, the job's controller that commits, Ray
Train's restarts), around your function; `checkpoint` takes the YAML
section's keys, defaults and checks (a dict, or a `CheckpointConfig`).
A restart resumes from this job's newest commit, the first start from
`checkpoint.load_path`; when your function returns, its last step is
committed if `maybe_save` did not save it.

What is saved, in the layout of every other ray_resume checkpoint: the
model, the optimizer's whole state (every slot of any torch.optim
optimizer, resharded on load like the model; and every param group's
hyperparameters, so an LR scheduler's changes come back), each rank's RNG
streams (torch, numpy, python, CUDA), and `extra`: objects with
`state_dict()` / `load_state_dict()` (LR schedulers, counters) or
`torch.Generator`s, per rank (ray_resume.extra_state). On another world
size every rank gets rank 0's param groups and extra state, and its RNG
streams are not restored (each rank keeps the ones it has). common.json
records the `consumed_samples` and `global_batch_size` your loop gives
`maybe_save` (null where it gives none). Between saves `maybe_save` also
snapshots all of it into memory (`checkpoint.memory_interleaved_steps`,
`auto` by default), and a restart of the same size resumes from there
(ray_resume.checkpoint.memory).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import ray.train

from .checkpoint.restore import Start
from .config import CheckpointConfig, Config, load_config, redacted
from .driver import Result, TrainingFailed, launch
from .ray_backend import RayTrain
from .errors import ConfigError
from .faults import Fault
from .plugins import resolve
from .preflight import absolute_paths, check_built_in, check_model, data_units
from .rank import get_checkpointer
from .train_loop import train_func as built_in_train_func

__all__ = ["fit", "train", "get_checkpointer", "Result", "Start", "TrainingFailed", "CheckpointConfig"]


def fit(
    train_func: Callable[[dict], None],
    *,
    checkpoint: CheckpointConfig | dict,
    train_loop_config: dict | None = None,
    scaling_config: ray.train.ScalingConfig | dict | None = None,
    run_config: ray.train.RunConfig | None = None,
    failure_config: ray.train.FailureConfig | dict | None = None,
    address: str | None = None,
    verbose: bool = False,
) -> Result:
    """Run `train_func(train_loop_config)` on every rank with ray_resume's checkpointing, as
    `TorchTrainer(train_func, ...).fit()` would; the Result, or TrainingFailed (a ray.train.TrainingFailedError)
    when the run fails. Bad keys and checkpoints are refused here, before Ray starts."""
    if isinstance(failure_config, ray.train.FailureConfig):
        failure_config = {"max_failures": failure_config.max_failures}
    elif failure_config is None:
        failure_config = (
            {"max_failures": run_config.failure_config.max_failures} if run_config and run_config.failure_config else {}
        )
    cfg = absolute_paths(
        Config.from_dict(
            {
                "name": (run_config.name if run_config and run_config.name else "fit"),
                "checkpoint": checkpoint.model_dump() if isinstance(checkpoint, CheckpointConfig) else checkpoint,
                "scaling": _scaling_section(scaling_config),
                "failure": failure_config,
                "training": None,
            },
            source="ray_resume.fit",
        )
    )
    backend = RayTrain(
        address,
        scaling_config=scaling_config if isinstance(scaling_config, ray.train.ScalingConfig) else None,
        run_config=run_config,
        verbose=verbose,
    )
    result = launch(
        cfg,
        train_func,
        dict(train_loop_config or {}),
        check=lambda cfg, source, it: cfg,
        backend=backend,
        summary=False,
    )
    if result.error is not None:
        raise result.error
    return result


def _scaling_section(scaling) -> dict:
    """The `scaling:` keys of Ray Train's ScalingConfig (what ray_resume checks; Ray Train gets yours as it is)."""
    if not isinstance(scaling, ray.train.ScalingConfig):
        return dict(scaling or {})
    workers = scaling.num_workers
    return {
        "num_workers": list(workers) if isinstance(workers, tuple) else workers,
        "use_gpu": bool(scaling.use_gpu),
        "resources_per_worker": dict(scaling.resources_per_worker or {}),
        **(
            {"elastic_resize_interval_s": float(scaling.elastic_resize_monitor_interval_s)}
            if scaling.elastic_resize_monitor_interval_s is not None
            else {}
        ),
    }


def train(
    config,
    *,
    build_model=None,
    loss=None,
    collate=None,
    address: str | None = None,
    overrides=(),
    verbose: bool = False,
    backend=None,
    fault: Fault | dict | None = None,
) -> Result:
    """Run the built-in job exactly as `python -m ray_resume.run` does; its Result, or the error it failed
    with raised (TrainingFailed; ConfigError, CheckpointError or DataError for a mistake of the user's).

    `config` is a YAML path, a dict or a `ray_resume.config.Config`; `build_model(model_section) ->
    nn.Module`, `loss(model, batch) -> scalar` and `collate(arrays) -> batch` replace the config's import
    paths; all are checked here, before Ray starts. `verbose` keeps Ray Train's and Ray Data's own
    console lines. `backend` runs the ranks (ray_backend.RayTrain by default; the tests' local processes).
    `fault` (a `faults.Fault` or its fields) kills a rank or the driver once, on purpose: the tests'
    and the quickstart's drill.
    """
    if isinstance(config, (str, os.PathLike)):
        config = load_config(config, overrides)
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    if config.training is None:
        raise ConfigError(f"{config.name}: the built-in job needs a training section")
    if isinstance(fault, dict):
        fault = Fault(**fault)
    if fault is not None:
        fault.within(config.scaling.max_workers)
    cfg = absolute_paths(config)
    plugins = resolve(cfg, build_model=build_model, loss=loss, collate=collate)
    check_model(cfg, plugins)
    units = data_units(cfg, plugins)
    # Ray Train keeps train_loop_config in its run state (the dashboard shows it): credentials stay
    # out of it, and the ranks take the whole config from the controller.
    loop_config = {
        "config": redacted(cfg.to_dict()),
        "plugins": plugins,
        "verbose": verbose,
        "units": [dataclasses.astuple(u) for u in units],
    }
    result = launch(
        cfg,
        built_in_train_func,
        loop_config,
        check=lambda cfg, source, it: check_built_in(cfg, plugins, units, source, it),
        backend=backend or RayTrain(address, verbose=verbose),
        fault=fault,
    )
    if result.error is not None:
        raise result.error
    return result
