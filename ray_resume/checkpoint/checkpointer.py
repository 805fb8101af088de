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
from .reader import load_rank_extras, load_state, open_iteration, read_export
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

    def restore(self, model, optimizer, source: tuple[str, int | None] | None, *, full: bool) -> ResumePoint:
        """Load `source = (root, step)`, or `(export_dir, None)` for consolidated safetensors weights.

        `full` restores optimizer, RNG and progress too (the spec's
        no_load_optim: false); otherwise only weights are taken, training
        starts at step 0, and the fp32 main params are refreshed from them.
        """
        if source is None:
            return ResumePoint()
        root, step = source
        storage = storage_for(root, self.ckpt.storage)
        if step is None:
            load_weights(model, read_export(storage, root), root)
            optimizer.reload_main_params_from_model()
            return ResumePoint(source=root)
        it = open_iteration(storage, root, step)
        load_weights(model, load_state(storage, it, layout.MODEL_KIND), layout.join(it.path, layout.METADATA))
        if not full:
            optimizer.reload_main_params_from_model()
            return ResumePoint(source=it.path)
        if optimizer is None:
            raise CheckpointError(f"{it.path}: no optimizer was built to restore into; set checkpoint.no_load_optim: true to load weights only")
        point = ResumePoint(it.common["global_step"], it.common["consumed_samples"], it.path)
        if not it.common["has_optimizer"]:
            # Only reachable on a restart inside a job saved with no_save_optim: keep
            # the progress, but the optimizer starts over (nothing else to resume).
            logger.warning("%s has no optimizer state (no_save_optim): resuming weights and progress, fresh optimizer", it.path)
            optimizer.reload_main_params_from_model()
            return point
        optimizer.load_state_tensors(load_state(storage, it, layout.OPTIM_KIND))
        if optimizer.scaler:
            optimizer.scaler.load(it.common)
        if it.common["world_size"] == self.world_size:
            state.restore_rng(load_rank_extras(storage, it, self.rank))
        else:
            logger.warning("world size changed (%d -> %d): RNG streams are reseeded, not restored", it.common["world_size"], self.world_size)
        return point

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
            optim_state=None if self.ckpt.no_save_optim else optimizer.state_tensors(),
            rank_extras=state.capture_rng(),
            on_mid_write=lambda: self.faults.maybe_kill("mid_shard_write", step),
        )
        self.faults.maybe_kill("before_report", step)
        ray.get(self.coordinator.report.remote(self.attempt, step, manifest, common))
        return True


def load_weights(model, weights: dict[str, torch.Tensor], where: str) -> None:
    """Load `weights` into `model` after checking names, shapes and dtypes, naming the first misfit."""
    current = state.model_tensors(model)
    for name, tensor in current.items():
        if name not in weights:
            raise CheckpointError(f"{where}: model tensor {name!r} is missing; the model config differs from the one that saved it")
        got = weights[name]
        if tuple(got.shape) != tuple(tensor.shape) or got.dtype != tensor.dtype:
            raise CheckpointError(
                f"{where}: tensor {name!r} is {got.dtype} {list(got.shape)} there but "
                f"{tensor.dtype} {list(tensor.shape)} in the model; the model config differs from the one that saved it"
            )
    extra = sorted(set(weights) - set(current))
    if extra:
        raise CheckpointError(f"{where}: tensor {extra[0]!r} is not a tensor of the model")
    state.unwrap(model).load_state_dict(weights)
