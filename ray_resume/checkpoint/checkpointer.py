"""Worker side of checkpointing: restore once at start, maybe save each step.

The training loop calls `restore()` once and `maybe_save(step)` every step
(torchtitan's shape). Everything a rank needs to decide what to load comes
from the driver, so all ranks of a group agree on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
import torch

from . import layout, state
from .reader import load_rank_extras, load_state, open_iteration
from .schema import CheckpointError
from .storage import storage_for
from .writer import save_shards

logger = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """Where training continues: the next step is `global_step + 1`."""

    global_step: int = 0
    consumed_samples: int = 0
    source: str | None = None  # the iteration dir loaded, None for a fresh start


class Checkpointer:
    def __init__(self, cfg, coordinator, rank: int, world_size: int, attempt: int, faults):
        self.cfg = cfg
        self.ckpt = cfg.checkpoint
        self.coordinator = coordinator
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.faults = faults

    def restore(self, model, optimizer, source: tuple[str, int] | None, *, full: bool) -> ResumePoint:
        """Load iteration `source = (root, step)`; `full` also restores optimizer, RNG and progress."""
        if source is None:
            return ResumePoint()
        root, step = source
        storage = storage_for(root, self.ckpt.storage)
        it = open_iteration(storage, root, step)
        weights = load_state(storage, it, layout.MODEL_KIND)
        check_matches(state.model_tensors(model), weights, it, "model")
        state.unwrap(model).load_state_dict(weights)
        if not full:
            return ResumePoint(source=it.path)
        if not it.common["has_optimizer"] or optimizer is None:
            raise CheckpointError(
                f"{it.path}: iteration {step} has no optimizer state (saved with checkpoint.no_save_optim: true) "
                "or no optimizer was built; set checkpoint.no_load_optim: true to load its weights only"
            )
        state.load_optim_tensors(model, optimizer, load_state(storage, it, layout.OPTIM_KIND))
        if it.common["world_size"] == self.world_size:
            state.restore_rng(load_rank_extras(storage, it, self.rank))
        else:
            logger.warning("world size changed (%d -> %d): RNG streams are reseeded, not restored", it.common["world_size"], self.world_size)
        return ResumePoint(it.common["global_step"], it.common["consumed_samples"], it.path)

    def should_save(self, step: int) -> bool:
        c = self.ckpt
        return c.enable_save and (step % c.save_interleaved_steps == 0 or step == self.cfg.training.train_steps)

    def maybe_save(self, step: int, model, optimizer, common: dict) -> bool:
        """Write this rank's shards of `step` and report them to the driver. True if it saved."""
        if not self.should_save(step):
            return False
        manifest = save_shards(
            storage_for(self.ckpt.save_path, self.ckpt.storage), self.ckpt.save_path, step,
            prefix=self.ckpt.prefix, rank=self.rank, world_size=self.world_size,
            model_state=state.model_tensors(model),
            optim_state=None if self.ckpt.no_save_optim else state.optim_tensors(model, optimizer),
            rank_extras=state.capture_rng(),
            on_mid_write=lambda: self.faults.maybe_kill("mid_shard_write", step),
        )
        self.faults.maybe_kill("before_report", step)
        ray.get(self.coordinator.report.remote(self.attempt, step, manifest, common))
        return True


def check_matches(current: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], it, kind: str) -> None:
    """Refuse a checkpoint whose tensors do not fit the model, naming the first misfit."""
    where = layout.join(it.path, layout.METADATA)
    for name, tensor in current.items():
        if name not in loaded:
            raise CheckpointError(f"{where}: {kind} tensor {name!r} of the model is not in the checkpoint; the model config differs from the one that saved it")
        got = loaded[name]
        if tuple(got.shape) != tuple(tensor.shape) or got.dtype != tensor.dtype:
            raise CheckpointError(
                f"{where}: {kind} tensor {name!r} is {got.dtype} {list(got.shape)} in the checkpoint but "
                f"{tensor.dtype} {list(tensor.shape)} in the model; the model config differs from the one that saved it"
            )
    extra = sorted(set(loaded) - set(current))
    if extra:
        raise CheckpointError(f"{where}: {kind} tensor {extra[0]!r} is in the checkpoint but not in the model")
