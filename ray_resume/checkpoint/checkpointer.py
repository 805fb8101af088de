"""One rank's checkpointing: restore from what the job resumes, save this rank's share of a step,
snapshot it into the memory tier.

Whether a step is saved is decided above (`rank.RankCheckpointer`); what
to load is the group's `ResumePlan` (decided by the driver or the controller),
so all ranks of a group agree on it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from ..collectives import collective_device, decided_by_rank0, smallest
from ..errors import CheckpointError, DamagedShards, WriterDied
from . import memory, names, paths, state
from .async_save import BackgroundSave
from .dcp import load_dcp, optimizer_specs, weight_specs
from .fallback import fall_back
from .iterations import resume_step
from .checks import check_optimizer_state, check_weights, refuse_foreign_slots, refuse_optimizer_change
from .loader import (
    StateLoader,
    assign,
    from_mindformers,
    is_fsdp_shard,
    load_weights,
    open_shared,
    read_export,
    shaped,
)
from .plan import TensorSpec, needed_range
from .reader import load_rank_extras
from .root import CheckpointRoot, CommittedIteration, DcpCheckpoint, ResumeSource, WeightsExport, root_for
from .state import DTYPE_TAGS, DTYPES, class_path, optimizer_slots
from .shard_file import ShardFile
from .writer import SnapshotBuffers, live_data, shard_files, shard_layouts, write_shards
from .writer_process import ProcessWriter, writes_in_a_process

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """Where a loop continues: its next step is `step + 1`."""

    step: int = 0
    consumed_samples: int = 0
    source: str | None = None  # the iteration (or export, or memory snapshot) loaded; None for a fresh start
    bytes_read: int = 0  # bytes this rank read from storage for it


class Checkpointer:
    def __init__(self, ckpt, controller, rank: int, world_size: int, attempt: int, faults):
        self.ckpt = ckpt  # the config's checkpoint section
        self.controller = controller  # the job's controller, a controller.client.ControllerClient (or a stand-in)
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.faults = faults
        self.snapshots = SnapshotBuffers()  # async: reused host copies of this rank's share
        self.writer: ProcessWriter | None = None  # async: the writer process, if one writes them (writer_process)
        if writes_in_a_process(ckpt, None):  # asked for: started now, its imports done by the first save
            self._start_writer()
        self.background = BackgroundSave(f"ckpt-writer-{rank}")
        self.memory_sender = BackgroundSave(f"ckpt-memory-{rank}")  # the memory tier's: one snapshot in flight
        self.keeper = None  # this node's MemoryKeeper, once asked
        self.last_stall_s: float | None = None  # seconds the last save blocked the training loop
        self.stalls: list[tuple[int, float]] = []  # (step, stall seconds) of every save, in order
        self.export_facts: dict | None = None  # rank 0: state.export_facts of the model, taken at its first save

    def restore(
        self,
        model,
        optimizer,
        source: ResumeSource | None,
        *,
        full: bool,
        global_batch_size: int | None = None,
        rank0_extras: bool = False,
        step: int | None = None,
    ) -> tuple[Start, dict[str, str]]:
        """Load `source` into the live model (and optimizer); where to continue, and the rank's strings
        from its opt header (param groups, extra state).

        `full` restores optimizer, RNG and progress too (the spec's
        no_load_optim: false); otherwise only weights are taken, training
        starts at step 0, and the fp32 main params are refreshed from them.
        A `global_batch_size` other than the saved one rescales the step (iterations.resume_step).
        `rank0_extras`: on another world size, every rank takes rank 0's extras (param groups, extra state).
        `step`: the step a DCP checkpoint without `train_state.step` was taken at (the loop's word).
        """
        if source is None:
            return Start(), {}
        if isinstance(source, WeightsExport):
            weights, read = read_export(root_for(source.path, self.ckpt.storage).storage, source.path)
            load_weights(model, weights, source.path, self.rank, self.world_size)
            optimizer.reload_main_params_from_model()
            return Start(source=source.path, bytes_read=read), {}
        if isinstance(source, DcpCheckpoint):
            return self._restore_dcp(model, optimizer, source.path, full=full, gbs=global_batch_size, step=step), {}
        root = root_for(source.root, self.ckpt.storage)
        try:
            return self._restore(
                root,
                model,
                optimizer,
                source.step,
                full=full,
                gbs=global_batch_size,
                rank0_extras=rank0_extras,
            )
        except DamagedShards as exc:  # every rank gets here (the loader agrees), with the same step
            logger.warning("rank %d: %s", self.rank, exc)
            damage = str(exc)
            older = decided_by_rank0(
                lambda: fall_back(root, source.step, damage, fallback=self.ckpt.fallback).step,
                self.rank,
                f"fall back from the damaged iteration {source.step}",
            )
            return self.restore(
                model,
                optimizer,
                CommittedIteration(source.root, older),
                full=full,
                global_batch_size=global_batch_size,
                rank0_extras=rank0_extras,
            )

    def _restore(
        self, root: CheckpointRoot, model, optimizer, step: int, *, full: bool, gbs: int | None, rank0_extras: bool
    ) -> tuple[Start, dict[str, str]]:
        try:
            it = open_shared(root, step, self.rank, self.world_size)
        except CheckpointError as exc:
            if not root.storage.is_dir(root.iteration_dir(step)):
                # Set aside by an earlier attempt of this job, whose ranks found it damaged: the
                # restart falls back the same way, where the driver and controller still name it.
                raise DamagedShards(str(exc)) from exc
            raise
        kinds = (paths.MODEL_KIND, paths.OPTIM_KIND) if full and it.has_optimizer else (paths.MODEL_KIND,)
        loader = StateLoader(root.storage, it, self.rank, self.world_size, self.ckpt.load_balanced, kinds)
        where = paths.join(it.path, paths.METADATA)
        live = state.model_tensors(model)
        specs = it.specs(paths.MODEL_KIND)
        check_weights(live, specs, state.tied_aliases(model), where)
        assign(live, self._load(loader, paths.MODEL_KIND, specs, live, into=live))
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
            specs = {
                n: spec for n, spec in it.specs(paths.OPTIM_KIND).items() if names.parse_state_name(n)[0] is not None
            }
            params = dict(optimizer.named_main())  # a slot is sharded like its parameter
            check_optimizer_state(specs, {n: tuple(p.shape) for n, p in params.items()}, where)
            flat = self._load(
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
            elif it.world_size == self.world_size:
                extras = load_rank_extras(loader.reader, self.rank)
                state.restore_rng(extras)
            else:  # the RNG streams stay as they are
                extras = load_rank_extras(loader.reader, 0) if rank0_extras else {}
                logger.warning(
                    "world size changed (%d -> %d): RNG streams are reseeded, not restored",
                    it.world_size,
                    self.world_size,
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

    def _restore_dcp(self, model, optimizer, path: str, *, full: bool, gbs: int | None, step: int | None) -> Start:
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
        self, loader: StateLoader, kind: str, specs: dict[str, TensorSpec], live: dict, into: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """This rank's part of every tensor in `specs`: its dim-0 chunk where the live tensor is an FSDP shard, else all.

        Where `into` has a CPU tensor that holds exactly that part in the saved
        dtype, the bytes land in it directly.
        """
        sharded = {n for n, t in live.items() if is_fsdp_shard(specs[n], t)}
        ranges = {n: needed_range(specs[n], n in sharded, self.world_size, self.rank) for n in specs}
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

    def poll(self) -> None:
        """Raise the error of a background save that failed (once), at any step, saving or not."""
        self.background.poll()

    def save(self, step: int, model, optimizer, common: dict, *, extras: dict[str, str] | None = None) -> None:
        """Save this rank's shards of `step` and report them to the driver.

        With `checkpoint.async_save` (default) the share is copied into the
        reused snapshot buffers and a background thread writes and reports
        it; otherwise both happen here. Either way the time the loop was
        blocked here (a previous save still being written included) is
        logged and left in `last_stall_s`. An error of a background save is
        raised here (or by `finish()`), never dropped.
        """
        self.background.poll()
        start = time.perf_counter()
        waited = self.background.wait()  # a new save waits for the previous one (its buffers are reused)
        states = {
            paths.MODEL_KIND: state.with_rank0_buffers(model, state.model_tensors(model), collective_device()),
            paths.OPTIM_KIND: None if self.ckpt.no_save_optim else optimizer.state_tensors(),
        }
        shards = shard_layouts(states, self.rank, self.world_size)
        rng = {**state.capture_rng(), **(extras or {})}  # on the training thread: the state at this step
        common = dict(common)
        if self.rank == 0 and self.export_facts is None:  # the model's structure does not change in a run
            self.export_facts = state.export_facts(model)
        files = shard_files(  # their headers first: an async save places its snapshots by their lengths
            self.ckpt.save_path,
            step,
            shards,
            prefix=self.ckpt.prefix,
            rank=self.rank,
            world_size=self.world_size,
            rank_extras=rng,
        )
        if self.ckpt.async_save:
            if (
                self.writer is None
                and not self.stalls
                and writes_in_a_process(self.ckpt, sum(s.nbytes for s in shards))
            ):
                self._start_writer()  # `auto` decides at the first save (none stalled yet), by this rank's share
            if self.writer is not None:
                self.writer.ensure_started()  # on this thread: the writer dies with it (writer_process)
            shards = [(s, self.snapshots.take(s, states[s.kind], len(f.head))) for s, f in zip(shards, files)]
            self.background.submit(step, lambda: self._write_and_report(step, shards, files, rng, common, self.writer))
        else:
            self._write_and_report(step, [(s, live_data(s, states[s.kind])) for s in shards], files, rng, common)
        stall = time.perf_counter() - start
        self.last_stall_s = stall
        self.stalls.append((step, stall))
        logger.debug(
            "rank %d: save of iteration %d blocked training %.3f s (%s; %.3f s of it waiting for the previous save)",
            self.rank,
            step,
            stall,
            "async" if self.ckpt.async_save else "sync",
            waited,
        )

    def snapshot(self, step: int, model, optimizer, common: dict, extras: dict[str, str]) -> int:
        """Copy this rank's whole state at `step` and send it to its node's MemoryKeeper in the
        background (see checkpoint.memory); the bytes of its tensors."""
        start = time.perf_counter()
        self.memory_sender.wait()  # at most one snapshot in flight: memory stays bounded
        snap = {
            "tensors": {
                paths.MODEL_KIND: memory.pack(state.model_tensors(model)),
                paths.OPTIM_KIND: memory.pack(optimizer.state_tensors()),
            },
            "rng": state.capture_rng(),
            "extras": dict(extras),
            "common": dict(common),
        }
        if self.keeper is None:
            node = memory.node_id()
            self.keeper = (self.controller.keeper_for(node), node)
        keeper, node = self.keeper

        def send():
            try:
                self.controller.keep_snapshot(keeper, step, self.rank, snap)
                self.controller.snapshotted(step, self.rank, self.world_size, node)
            except Exception as exc:  # the tier is a shortcut: without this snapshot a restart reads storage
                logger.warning(
                    "rank %d: memory snapshot of step %d not kept (%s)", self.rank, step, str(exc).splitlines()[0][:160]
                )

        self.memory_sender.submit(step, send)
        logger.debug(
            "rank %d: memory snapshot of step %d blocked training %.3f s", self.rank, step, time.perf_counter() - start
        )
        return sum(data.nbytes for kind in snap["tensors"].values() for _, _, data in kind.values())

    def restore_snapshot(self, model, optimizer, step: int) -> tuple[Start, dict[str, str]] | None:
        """This rank's state from its memory snapshot of `step`; None on every rank if any rank's
        is gone (a node lost with its keeper): then the group restores from storage."""
        snap = None
        for i, keeper in enumerate(self.controller.snapshot_keepers(step, self.rank)):
            try:
                snap = memory.fetch(keeper, step, self.rank)
            except Exception as exc:  # the keeper died with its node: the replica, if there is one
                logger.warning(
                    "rank %d: the %s of its memory snapshot of step %d is gone (%s)",
                    self.rank,
                    "replica" if i else "copy on its node",
                    step,
                    str(exc).splitlines()[0][:160],
                )
                continue
            if snap is not None:
                if i:
                    logger.warning(
                        "rank %d: restoring step %d from the replica of its memory snapshot", self.rank, step
                    )
                break
        [everywhere] = smallest([int(snap is not None)])
        if not everywhere:
            if self.rank == 0:
                self.controller.snapshot_lost(step)
                logger.warning("the memory snapshot of step %d is not complete any more: restoring from storage", step)
            return None
        assign(state.model_tensors(model), memory.unpack(snap["tensors"][paths.MODEL_KIND]))
        optimizer.load_state_tensors(memory.unpack(snap["tensors"][paths.OPTIM_KIND]))
        common = snap["common"]
        if optimizer.scaler:
            optimizer.scaler.load(common)
        state.restore_rng(snap["rng"])
        return Start(common["global_step"], common["consumed_samples"], memory.MEMORY_SOURCE.format(step=step)), snap[
            "extras"
        ]

    def close(self) -> float:
        """Wait for the save in flight (so its commit happens before the worker returns); seconds blocked.

        Raises the error of a failed background save.
        """
        self.memory_sender.close()
        waited = self.background.close()
        if waited:
            logger.debug("rank %d: waited %.3f s for the last save to finish", self.rank, waited)
        return waited

    def _start_writer(self) -> None:
        self.snapshots = SnapshotBuffers(shared=True)
        self.writer = ProcessWriter(self.ckpt.save_path, self.ckpt.storage.model_dump(), self.snapshots)
        self.writer.ensure_started()

    def _write_and_report(
        self, step: int, shards, files: list[ShardFile], rng: dict[str, str], common: dict, writer=None
    ) -> None:
        try:
            manifest = write_shards(
                root_for(self.ckpt.save_path, self.ckpt.storage).storage,
                self.ckpt.save_path,
                step,
                prefix=self.ckpt.prefix,
                rank=self.rank,
                world_size=self.world_size,
                shards=shards,
                rank_extras=rng,
                checksum=self.ckpt.checksum,
                on_mid_write=(lambda: self.faults.maybe_kill("mid_shard_write", step))
                if self.faults.armed("mid_shard_write")
                else None,
                writer=writer,
                files=files,
            )
        except WriterDied as exc:  # that save is lost, never committed; the next one starts a new writer
            logger.warning(
                "rank %d: iteration %d is not saved: %s; the next save starts a new writer", self.rank, step, exc
            )
            return
        self.faults.maybe_kill("before_report", step)
        if self.rank == 0:
            manifest = dataclasses.replace(manifest, model=self.export_facts)
        self.controller.report(self.attempt, step, manifest, common)
