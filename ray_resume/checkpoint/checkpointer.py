"""One rank's checkpointing: restore what the job resumes (the kinds of restore: `restore`), falling
back past damage; save this rank's share of a step; snapshot it into the memory tier.

Whether a step is saved is decided above (`rank.RankCheckpointer`); what
to load is the group's `ResumePlan` (decided by the driver or the controller),
so all ranks of a group agree on it.
"""

from __future__ import annotations

import dataclasses
import logging
import time


from ..collectives import collective_device, decided_by_rank0, smallest
from ..errors import DamagedShards, WriterDied
from . import memory
from .format import paths, state
from .io.async_save import BackgroundSave
from .fallback import fall_back
from .async_choice import AsyncChoice
from .keeper import Snapshot
from .restore import Start, restore_committed, restore_dcp, restore_export
from .loader import (
    assign,
)
from .root import CommittedIteration, DcpCheckpoint, ResumeSource, WeightsExport, root_for
from .io.shard_file import ShardFile
from .io.writer import SnapshotBuffers, live_data, shard_files, shard_layouts, write_shards
from .io.writer_process import ProcessWriter, writes_in_a_process

logger = logging.getLogger(__name__)


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
        self._writer_chosen = False  # `async_writer: auto` decides at the first save that may go async
        self.choice = AsyncChoice() if ckpt.async_save == "auto" else None  # `async_save: auto`'s measures
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
            return restore_export(model, optimizer, source, self.ckpt.storage, self.rank, self.world_size), {}
        if isinstance(source, DcpCheckpoint):
            return restore_dcp(model, optimizer, source.path, full=full, gbs=global_batch_size, step=step), {}
        root = root_for(source.root, self.ckpt.storage)
        try:
            return restore_committed(
                root,
                model,
                optimizer,
                source.step,
                full=full,
                gbs=global_batch_size,
                rank0_extras=rank0_extras,
                rank=self.rank,
                world_size=self.world_size,
                load_balanced=self.ckpt.load_balanced,
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

    def poll(self) -> None:
        """Raise the error of a background save that failed (once), at any step, saving or not."""
        self.background.poll()

    def save(self, step: int, model, optimizer, common: dict, *, extras: dict[str, str] | None = None) -> None:
        """Save this rank's shards of `step` and report them to the driver.

        With `checkpoint.async_save` (default) the share is copied into the
        reused snapshot buffers and a background thread writes and reports
        it; otherwise both happen here (`auto`: as the first saves measure,
        checkpoint.async_choice). Either way the time the loop was
        blocked here (a previous save still being written included) is
        logged and left in `last_stall_s`. An error of a background save is
        raised here (or by `finish()`), never dropped.
        """
        self.background.poll()
        start = time.perf_counter()
        waited = self.background.wait()  # a new save waits for the previous one (its buffers are reused)
        in_background = self._in_background(step, start, waited)
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
        # `auto`'s warm-up save is written here from the snapshot, which puts its buffers' pages in place
        if in_background or (self.choice is not None and self.choice.warming_up):
            if not self._writer_chosen and self.writer is None:
                if writes_in_a_process(self.ckpt, sum(s.nbytes for s in shards)):  # by this rank's share
                    self._start_writer()
            self._writer_chosen = True
            if self.writer is not None:
                self.writer.ensure_started()  # on this thread: the writer dies with it (writer_process)
            taken = [self.snapshots.take(s, states[s.kind], f, self.ckpt.checksum) for s, f in zip(shards, files)]
            files = [f for f, _ in taken]  # with their digests: hashed as they were copied
            data = [(s, views) for s, (_, views) in zip(shards, taken)]
        else:
            data = [(s, live_data(s, states[s.kind])) for s in shards]
        if in_background:
            self.background.submit(step, lambda: self._write_and_report(step, data, files, rng, common, self.writer))
        else:
            self._write_and_report(step, data, files, rng, common)
        stall = time.perf_counter() - start
        self.last_stall_s = stall
        self.stalls.append((step, stall))
        if self.choice is not None:
            self.choice.saved(step, start, start + stall)
        logger.debug(
            "rank %d: save of iteration %d blocked training %.3f s (%s; %.3f s of it waiting for the previous save)",
            self.rank,
            step,
            stall,
            "async" if in_background else "sync",
            waited,
        )

    def _in_background(self, step: int, asked: float, waited: float) -> bool:
        """Whether the save of `step` is written in the background: `async_save`, or with `auto` as the
        group's first saves measure (rank 0 decides for all at the fourth, async_choice)."""
        if self.choice is None:
            return bool(self.ckpt.async_save)
        now = self.choice.next_is_async()
        if now is None:
            choice, why = decided_by_rank0(
                lambda: self.choice.measure(step, asked, waited), self.rank, "decide checkpoint.async_save: auto"
            )
            self.choice.decide(step, choice, why)
            if self.rank == 0:
                logger.info("checkpoint.async_save auto, at iteration %d: %s", step, why)
            if not choice:  # what only async saves use goes (the save measured has been waited for)
                if self.writer is not None:
                    self.writer.close()
                self.writer, self.snapshots = None, SnapshotBuffers()
            now = choice
        return now

    def snapshot(self, step: int, model, optimizer, common: dict, extras: dict[str, str]) -> int:
        """Copy this rank's whole state at `step` and send it to its node's MemoryKeeper in the
        background (see checkpoint.memory); the bytes of its tensors."""
        start = time.perf_counter()
        self.memory_sender.wait()  # at most one snapshot in flight: memory stays bounded
        snap = Snapshot(
            model=memory.pack(state.model_tensors(model)),
            optim=memory.pack(optimizer.state_tensors()),
            rng=state.capture_rng(),
            extras=dict(extras),
            common=dict(common),
        )
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
        return snap.nbytes

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
        if not isinstance(snap, Snapshot):
            raise TypeError(
                f"rank {self.rank}: its memory snapshot of step {step} came back as a {type(snap).__name__}"
            )
        assign(state.model_tensors(model), memory.unpack(snap.model))
        optimizer.load_state_tensors(memory.unpack(snap.optim))
        if optimizer.scaler:
            optimizer.scaler.load(snap.common)
        state.restore_rng(snap.rng)
        source = memory.MEMORY_SOURCE.format(step=step)
        return Start(snap.common["global_step"], snap.common["consumed_samples"], source), snap.extras

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
