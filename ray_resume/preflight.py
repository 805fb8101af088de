"""The driver's checks, before Ray starts: what a job resumes from, and whether it fits.

Every mistake a user can fix is found here and said in one line (what is
wrong, where, what to do), not in every rank of every attempt. The resume
source is resolved once, while the job holds the writer lease on
save_path (`driver.launch` calls `resolve_source` after taking it): a start
that finds a damaged iteration sets it aside only in a root it owns.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from . import parallel
from .checkpoint.format import names, paths, state
from .checkpoint.format.checks import (
    check_optimizer_state,
    check_weights,
    refuse_foreign_slots,
    refuse_optimizer_change,
)
from .checkpoint.fallback import select_iteration
from .checkpoint.io.iterations import resume_step
from .checkpoint.interop.dcp_checkpoint import (
    dcp_checkpoint,
    describe,
    full_resume_problem,
    optimizer_specs,
    weight_specs,
)
from .checkpoint.root import CommittedIteration, DcpCheckpoint, ResumeSource, WeightsExport, root_for
from .checkpoint.format.schema import Iteration
from .checkpoint.format.state import class_path, optimizer_slots
from .config import Config
from .data import (
    DEFAULT_COLUMNS,
    DEFAULT_LANES,
    ReadUnit,
    check_data_map,
    check_eval_set,
    check_lanes,
    data_fingerprint,
    dataset_size,
    ensure_dataset,
    fingerprint_changes,
    scan_units,
)
from .errors import CheckpointError, ConfigError, DataError
from .optim import optimizer_kwargs
from .plugins import expected_tokens, make_model

logger = logging.getLogger("ray_resume")


def absolute_paths(cfg: Config) -> Config:
    """Workers may run in another directory: hand them absolute local paths."""

    def fix(path: str) -> str:
        return os.path.abspath(paths.local_path(path)) if path and not paths.on_object_storage(path) else path

    ckpt = cfg.checkpoint.model_copy(
        update={"save_path": fix(cfg.checkpoint.save_path), "load_path": fix(cfg.checkpoint.load_path)}
    )
    data = cfg.data.model_copy(update={"path": fix(cfg.data.path), "eval_path": fix(cfg.data.eval_path)})
    return cfg.model_copy(update={"data": data, "checkpoint": ckpt})


def check_model(cfg: Config, plugins) -> None:
    """What needs only the config and the plugins: FSDP unit class names, on the model built on the meta device."""
    if cfg.training.strategy == "fsdp" and cfg.model.fsdp_units:
        with torch.device("meta"):  # check the unit class names without allocating the model
            parallel.fsdp_units(make_model(plugins, cfg), cfg.model.fsdp_units)


def data_units(cfg: Config, plugins) -> list[ReadUnit]:
    """The dataset's row groups: listed and their footers read once, here, for every rank, and
    checked against what the job takes from them (docs/data.md: what is checked where)."""
    ensure_dataset(cfg.data.path, cfg.data.synthetic, cfg.model.seq_len, cfg.model.vocab_size)
    units = scan_units(
        cfg.data.path,
        cfg.data.columns or None,
        cfg.checkpoint.storage,
        cfg.pack_tokens(),
        tokens=expected_tokens(plugins, cfg),
    )
    samples, batch = dataset_size(units), cfg.training.global_batch_size
    if samples < batch:
        what = f"{samples} windows of {cfg.pack_tokens()} tokens" if cfg.data.pack else f"{samples} samples"
        raise DataError(
            f"data.path {cfg.data.path!r} holds {what}, fewer than one global batch "
            f"(training.global_batch_size: {batch}); add data or lower training.global_batch_size"
        )
    return units


def resolve_source(cfg: Config) -> tuple[ResumeSource | None, Iteration | None]:
    """What `checkpoint.load_path` names, checked, and the iteration's JSON read once (None for an
    export or nothing); a save_path that would overwrite committed iterations is refused."""
    ckpt = cfg.checkpoint
    if not ckpt.enable_save:
        logger.warning("[%s] checkpoints are off (checkpoint.enable_save: false): nothing will be saved", cfg.name)
    source, it = _load_source(ckpt, built_in=cfg.training is not None) if ckpt.load_path else (None, None)
    resumes_own_root = isinstance(source, CommittedIteration) and source.root == ckpt.save_path
    if ckpt.enable_save and not resumes_own_root:
        save = root_for(ckpt.save_path, ckpt.storage)
        existing = save.committed() if save.exists() else None
        if existing is not None:
            raise CheckpointError(
                f"checkpoint.save_path {ckpt.save_path!r} already holds committed iteration {existing} of an earlier run; "
                "set checkpoint.load_path to the same directory to resume it, or choose an empty save_path"
            )
    if resumes_own_root and ckpt.enable_save and ckpt.no_load_optim:
        raise CheckpointError(
            f"checkpoint.save_path {ckpt.save_path!r} holds committed iteration {source.step}, and no_load_optim: true "
            "starts over at step 0, so this run's saves would overwrite it; set checkpoint.save_path to a new "
            "directory (checkpoint.load_path stays where it is)"
        )
    return source, it


def _load_source(ckpt, built_in: bool) -> tuple[ResumeSource | None, Iteration | None]:
    root = root_for(ckpt.load_path, ckpt.storage)
    resuming_own_root = ckpt.load_path == ckpt.save_path
    nothing_yet = (None, None)
    if not root.exists():
        if resuming_own_root:  # the first run of a "resume if there is anything" config
            logger.info("nothing to resume in %s yet: starting from step 0", ckpt.load_path)
            return nothing_yet
        raise CheckpointError(
            f"checkpoint.load_path {ckpt.load_path!r} does not exist or is not a directory; "
            "point it at the save_path of the run to resume (its root, not an iteration_* directory)"
        )
    if (dcp_dir := dcp_checkpoint(ckpt.load_path)) is not None:
        # A fit() loop may say the step itself (`restore(..., step=)`): its ranks check.
        if problems := describe(dcp_dir)["problems"]:
            raise CheckpointError(f"{problems[0]}; the DCP checkpoint at {dcp_dir} is damaged or incomplete")
        if not ckpt.no_load_optim and (problem := full_resume_problem(dcp_dir, step_given=not built_in)):
            raise CheckpointError(
                f"{dcp_dir}: a torch.distributed.checkpoint (DCP) checkpoint that cannot be resumed whole: "
                f"{problem}; set checkpoint.no_load_optim: true to start from its weights"
            )
        return DcpCheckpoint(dcp_dir), None
    if root.is_export():
        if not ckpt.no_load_optim:
            raise CheckpointError(
                f"checkpoint.load_path {ckpt.load_path!r} is a weights-only safetensors export (no optimizer state); "
                "set checkpoint.no_load_optim: true to start from its weights"
            )
        return WeightsExport(ckpt.load_path), None
    it = select_iteration(root, fallback=ckpt.fallback)
    if it is None:
        if resuming_own_root:
            logger.info("nothing to resume in %s yet: starting from step 0", ckpt.load_path)
            return nothing_yet
        raise CheckpointError(
            f"checkpoint.load_path {ckpt.load_path!r} holds neither {paths.TRACKER} nor model.safetensors; "
            "point it at a checkpoint root written by ray_resume or at a safetensors export"
        )
    if not ckpt.no_load_optim and not it.has_optimizer:
        raise CheckpointError(
            f"{it.path}: iteration {it.step} was saved without optimizer state (checkpoint.no_save_optim: true); "
            "set checkpoint.no_load_optim: true to start from its weights"
        )
    return CommittedIteration(ckpt.load_path, it.step), it


def with_lanes(cfg: Config, it: Iteration | None) -> Config:
    """`data.lanes: 0` made definite: the lanes of the iteration a full resume continues (1 if it has
    none: its order was made before there were lanes), else gcd(global_batch_size, DEFAULT_LANES)."""
    if cfg.data.lanes:
        return cfg
    lanes = math.gcd(cfg.training.global_batch_size, DEFAULT_LANES)
    if it is not None and not cfg.checkpoint.no_load_optim:
        lanes = it.ours.get("data", {}).get("lanes", 1)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"lanes": lanes})})


def check_built_in(
    cfg: Config, plugins, units: list[ReadUnit], source: ResumeSource | None, it: Iteration | None
) -> Config:
    """The built-in job's checks of data, evaluation set and what it resumes against its model,
    optimizer and data; the config with its data lanes made definite."""
    cfg = with_lanes(cfg, it)
    if plugins.data_map:
        check_data_map(
            units, plugins.data_map, cfg.data.columns or DEFAULT_COLUMNS, cfg.checkpoint.storage, cfg.pack_tokens()
        )
    if cfg.training.eval_every:
        check_eval_set(
            cfg.data.eval_path,
            cfg.data.columns or None,
            cfg.scaling.max_workers * cfg.training.micro_batch_size,
            cfg.checkpoint.storage,
            cfg.pack_tokens(),
        )
    if isinstance(source, WeightsExport):
        refuse_misfit_weights(cfg, plugins, root_for(source.path, cfg.checkpoint.storage).export_specs(), source.path)
        return cfg
    if isinstance(source, DcpCheckpoint):
        slots = None if cfg.checkpoint.no_load_optim else optimizer_specs(source.path)
        refuse_misfit_weights(cfg, plugins, weight_specs(source.path), source.path, optimizer=slots)
        if slots is not None:
            kwargs = {
                "lr": cfg.training.lr,
                **optimizer_kwargs(plugins.optimizer, cfg.training.weight_decay, cfg.training.optimizer_args),
            }
            now = class_path(plugins.optimizer)
            refuse_foreign_slots(
                slots,
                optimizer_slots(plugins.optimizer, kwargs),
                source.path,
                f"training.optimizer builds {now}",
                f"{now} from its weights",
                "set training.optimizer to the one that saved it",
            )
        return cfg
    if it is None:
        return cfg
    full = not cfg.checkpoint.no_load_optim
    refuse_misfit_weights(
        cfg,
        plugins,
        it.specs(paths.MODEL_KIND),
        paths.join(it.path, paths.METADATA),
        optimizer=it.specs(paths.OPTIM_KIND) if full else None,
    )
    if cfg.checkpoint.enable_save and it.root == cfg.checkpoint.save_path:
        refuse_step_rewind(cfg, it)
    if full:
        if it.common["consumed_samples"] is None:
            raise CheckpointError(
                f"{paths.join(it.path, paths.COMMON)}: iteration {it.step} records no consumed_samples (its loop did not count "
                "them), so the data cursor cannot be continued; set checkpoint.no_load_optim: true to start from its weights"
            )
        refuse_data_change(cfg, it, units)
        check_lanes(cfg.data.lanes, cfg.training.global_batch_size, dataset_size(units), it.common["consumed_samples"])
        kwargs = {
            "lr": cfg.training.lr,
            **optimizer_kwargs(plugins.optimizer, cfg.training.weight_decay, cfg.training.optimizer_args),
        }
        refuse_optimizer_change(
            it,
            plugins.optimizer,
            "training.optimizer builds {now}",
            "{now} from its weights",
            "set training.optimizer back",
            slots=optimizer_slots(plugins.optimizer, kwargs),
        )
    return cfg


def refuse_misfit_weights(cfg: Config, plugins, saved: dict, where: str, optimizer: dict | None = None) -> None:
    """Weights that do not fit the model (names, shapes, dtypes), and `optimizer` state of parameters it
    lacks, are the user's to fix: found here, on the model built on the meta device (no memory), not
    in every rank of every attempt."""
    try:
        with torch.device("meta"):
            model = make_model(plugins, cfg)
    except ConfigError:
        raise
    except Exception as exc:  # a builder that cannot build on the meta device (it reads weights, say): the ranks check
        logger.debug(
            "[%s] weights not checked on the driver: the model does not build on the meta device (%s)", cfg.name, exc
        )
        return
    check_weights(state.model_tensors(model), saved, state.tied_aliases(model), where)
    if optimizer:
        per_param = {n: spec for n, spec in optimizer.items() if names.parse_state_name(n)[0] is not None}
        check_optimizer_state(per_param, {n: tuple(p.shape) for n, p in model.named_parameters()}, where)


def refuse_data_change(cfg: Config, it: Iteration, units: list[ReadUnit]) -> None:
    """A full resume continues the saved data cursor; with another seed, shuffle, columns or dataset
    it would continue another order, silently. Refused unless `data.allow_change` says it is meant."""
    saved = it.ours.get("data")
    if saved is None:  # written before the fingerprint was kept
        return
    columns = cfg.data.columns or DEFAULT_COLUMNS
    changes = fingerprint_changes(
        saved, data_fingerprint(units, cfg.data.seed, cfg.data.shuffle, columns, cfg.data.lanes, cfg.pack_tokens())
    )
    if not changes:
        return
    what = "; ".join(changes)
    if cfg.data.allow_change:
        logger.warning(
            "[%s] data changed since iteration %d (%s); data.allow_change: true, so training continues "
            "at sample %d of the new order",
            cfg.name,
            it.step,
            what,
            it.common["consumed_samples"],
        )
        return
    raise CheckpointError(
        f"{paths.join(it.path, paths.COMMON)}: iteration {it.step} was trained on other data than this config reads "
        f"({what}), so resuming would continue another sample order; set data.allow_change: true if the change is "
        "meant (its data cursor carries over), or restore the data settings"
    )


def refuse_step_rewind(cfg: Config, it: Iteration) -> None:
    """A smaller resume step (a larger global_batch_size, spec 1.4) would save into the
    iteration directories of the run it resumes, committed ones included, while the
    tracker still names them: a crash then could leave the tracker on a half-rewritten
    iteration. Such a resume must write to a new save_path."""
    step, _ = resume_step(it.common, cfg.training.global_batch_size)
    if step < it.step:
        raise CheckpointError(
            f"global_batch_size {it.common['global_batch_size']} -> {cfg.training.global_batch_size} resumes iteration {it.step} "
            f"at step {step}, and its saves would overwrite iterations up to {it.step} in {it.root}; "
            "set checkpoint.save_path to a new directory (checkpoint.load_path stays where it is)"
        )
