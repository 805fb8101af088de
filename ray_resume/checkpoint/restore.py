"""A rank's restore of what its group resumes from storage: a committed iteration (ours, or one
MindFormers wrote), a DCP checkpoint (torchtitan's), or a consolidated export's weights. Which one,
and whether whole, is the group's `ResumePlan`; the fallback past damage and the memory tier's
snapshot are the checkpointer's (`checkpointer.Checkpointer.restore`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..errors import CheckpointError, DamagedShards
from .format import names, paths, state
from .format.checks import check_optimizer_state, check_weights, refuse_foreign_slots, refuse_optimizer_change
from .format.plan import TensorSpec, needed_range
from .format.state import DTYPE_TAGS, DTYPES, class_path, optimizer_slots
from .interop.dcp_checkpoint import load_dcp, optimizer_specs, weight_specs
from .io.iterations import resume_step
from .io.reader import load_rank_extras
from .loader import StateLoader, assign, from_mindformers, is_fsdp_shard, load_weights, open_shared, read_export, shaped
from .root import CheckpointRoot, WeightsExport, root_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """Where a loop continues: its next step is `step + 1`."""

    step: int = 0
    consumed_samples: int = 0
    source: str | None = None  # the iteration (or export, or memory snapshot) loaded; None for a fresh start
    bytes_read: int = 0  # bytes this rank read from storage for it


def restore_committed(
    root: CheckpointRoot,
    model,
    optimizer,
    step: int,
    *,
    full: bool,
    gbs: int | None,
    rank0_extras: bool,
    rank: int,
    world_size: int,
    load_balanced: bool,
) -> tuple[Start, dict[str, str]]:
    """A committed iteration of `root` into the live model (and, with `full`, optimizer, RNG and
    progress): where to continue, and the rank's strings from its opt header."""
    try:
        it = open_shared(root, step, rank, world_size)
    except CheckpointError as exc:
        if not root.storage.is_dir(root.iteration_dir(step)):
            # Set aside by an earlier attempt of this job, whose ranks found it damaged: the
            # restart falls back the same way, where the driver and controller still name it.
            raise DamagedShards(str(exc)) from exc
        raise
    kinds = (paths.MODEL_KIND, paths.OPTIM_KIND) if full and it.has_optimizer else (paths.MODEL_KIND,)
    loader = StateLoader(root.storage, it, rank, world_size, load_balanced, kinds)
    where = paths.join(it.path, paths.METADATA)
    live = state.model_tensors(model)
    specs = it.specs(paths.MODEL_KIND)
    check_weights(live, specs, state.tied_aliases(model), where)
    assign(live, _load(loader, paths.MODEL_KIND, specs, live, into=live))
    if not full:
        optimizer.reload_main_params_from_model()
        return Start(source=it.path, bytes_read=loader.bytes_read), {}
    if optimizer is None:
        raise CheckpointError(
            f"{it.path}: no optimizer was built to restore into; set checkpoint.no_load_optim: true to load weights only"
        )
    extras = {}
    refuse_optimizer_change(
        it,
        type(optimizer.optimizer),
        "this job's optimizer is {now}",
        "it from the weights",
        "build the optimizer that saved it",
        slots=optimizer_slots(optimizer.optimizer),
    )
    if it.has_optimizer:
        specs = {n: spec for n, spec in it.specs(paths.OPTIM_KIND).items() if names.parse_state_name(n)[0] is not None}
        params = dict(optimizer.named_main())  # a slot is sharded like its parameter
        check_optimizer_state(specs, {n: tuple(p.shape) for n, p in params.items()}, where)
        flat = _load(
            loader,
            paths.OPTIM_KIND,
            specs,
            {n: params[names.parse_state_name(n)[0]] for n in specs},
            # slots that exist already (a live optimizer) load in place
            into=optimizer.state_tensors(),
        )
        tensors = {n: shaped(flat[n], specs[n]) for n in specs}
        if it.origin == "mindformers":
            tensors = from_mindformers(tensors, it, loader, optimizer)
        optimizer.load_state_tensors(tensors)
        if optimizer.scaler:
            optimizer.scaler.load({**it.ours, **it.common})
        if it.origin == "mindformers":
            logger.warning(
                "%s was written by MindFormers: it holds no RNG streams, which are reseeded, not restored", it.path
            )
        elif it.world_size == world_size:
            extras = load_rank_extras(loader.reader, rank)
            state.restore_rng(extras)
        else:  # the RNG streams stay as they are
            extras = load_rank_extras(loader.reader, 0) if rank0_extras else {}
            logger.warning(
                "world size changed (%d -> %d): RNG streams are reseeded, not restored",
                it.world_size,
                world_size,
            )
    else:
        # Only reachable on a restart inside a job saved with no_save_optim: keep
        # the progress, but the optimizer starts over (nothing else to resume).
        logger.warning(
            "%s has no optimizer state (no_save_optim): resuming weights and progress, fresh optimizer", it.path
        )
        optimizer.reload_main_params_from_model()
    step, rescaled = resume_step(it.common, gbs)
    if rescaled:
        logger.warning(rescaled)
    return Start(step, it.common["consumed_samples"], it.path, loader.bytes_read), extras


def restore_dcp(model, optimizer, path: str, *, full: bool, gbs: int | None, step: int | None) -> Start:
    """A DCP checkpoint (torchtitan's), resharded by DCP's own planner: the weights, and with `full`
    the optimizer's slots and the step (`step` where the loop says it, else `train_state.step`; the
    data cursor is that step's samples at `gbs`). It holds no RNG streams: they are not restored."""
    live = state.model_tensors(model)
    check_weights(live, weight_specs(path), state.tied_aliases(model), path)
    if not full:
        read, _ = load_dcp(path, live)
        optimizer.reload_main_params_from_model()
        return Start(source=path, bytes_read=read)
    saved = optimizer_specs(path)
    now = class_path(type(optimizer.optimizer))
    refuse_foreign_slots(
        saved,
        optimizer_slots(optimizer.optimizer),
        path,
        f"this job's optimizer is {now}",
        "it from the weights",
        "build the optimizer that saved it",
    )
    params = dict(optimizer.named_main())
    check_optimizer_state(saved, {n: tuple(p.shape) for n, p in params.items()}, path)
    slots = {
        n: torch.zeros_like(params[names.parse_state_name(n)[0]])
        if spec.shape
        else torch.zeros((), dtype=DTYPES[spec.dtype])
        for n, spec in saved.items()
    }
    read, saved_step = load_dcp(path, live, slots)
    step = step if step is not None else saved_step
    if step is None:
        raise CheckpointError(
            f"{path}: a DCP checkpoint without train_state.step: say the step it was taken at, "
            "ck.restore(..., step=N), or set checkpoint.no_load_optim: true to start from its weights"
        )
    tensors = {n: state.local_tensor(t) for n, t in slots.items()}
    # a low-precision model's fp32 main params: DCP's holds none, so its weights
    if getattr(optimizer, "mixed", False):
        optimizer.reload_main_params_from_model()
        tensors |= {
            n: state.local_tensor(t)
            for n, t in optimizer.state_tensors().items()
            if names.parse_state_name(n)[1] == names.MAIN_PARAM
        }
    optimizer.load_state_tensors(tensors)
    logger.warning("%s is a DCP checkpoint: it holds no RNG streams, which are reseeded, not restored", path)
    return Start(step, step * (gbs or 0), path, read)


def _load(
    loader: StateLoader, kind: str, specs: dict[str, TensorSpec], live: dict, into: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor in `specs`: its dim-0 chunk where the live tensor is an FSDP shard, else all.

    Where `into` has a CPU tensor that holds exactly that part in the saved
    dtype, the bytes land in it directly.
    """
    sharded = {n for n, t in live.items() if is_fsdp_shard(specs[n], t)}
    ranges = {n: needed_range(specs[n], n in sharded, loader.world_size, loader.rank) for n in specs}
    targets = {n: state.local_tensor(into[n]).detach() for n in specs if torch.is_tensor(into.get(n))}
    in_place = {
        n: t.view(-1)
        for n, t in targets.items()
        if t.device.type == "cpu"
        and t.is_contiguous()
        and DTYPE_TAGS.get(t.dtype) == specs[n].dtype
        and t.numel() == ranges[n][1]
    }
    return loader.load(kind, ranges, shared=set(specs) - sharded, into=in_place)


def restore_export(model, optimizer, source: WeightsExport, storage_options, rank: int, world_size: int) -> Start:
    """A consolidated export's weights (no optimizer, RNG or progress: training starts at step 0)."""
    weights, read = read_export(root_for(source.path, storage_options).storage, source.path)
    load_weights(model, weights, source.path, rank, world_size)
    optimizer.reload_main_params_from_model()
    return Start(source=source.path, bytes_read=read)
