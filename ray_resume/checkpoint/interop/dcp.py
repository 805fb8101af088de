"""A ray_resume root read in place by PyTorch's own loader: `dcp.load(state_dict,
storage_reader=Reader(root))`. (The other way, a DCP checkpoint as a job's `load_path`, is
`dcp_checkpoint`.)

`torch.distributed.checkpoint` (DCP) loads by metadata: every tensor's global shape and the chunks
it was saved in (`TensorStorageMetadata`, `ChunkStorageMetadata`), and where each chunk lies
(`storage_data`). Our `metadata.json` holds the same facts in MindFormers' words (a tensor's
`global_shape`, its chunks' `global_offset`/`local_shape`, the file of each), so `Reader` gives DCP
its `Metadata` from it, and DCP's planner, on any world size, into plain tensors or FSDP2's
DTensors, asks each rank for the chunks that overlap what it holds. A rank reads the checksum
blocks those chunks lie in (and the header's), every block checked as our own loader checks it,
straight from storage; nothing is unpickled and nothing is written.

Names are those `torch.distributed.checkpoint.state_dict.get_state_dict` gives, under the keys
torchtitan and DCP's docs use: `{"model": model_sd, "optim": optim_sd}` flattens to
`model.{param}` and `optim.state.{param}.{slot}` (`exp_avg`, `exp_avg_sq`, `step`, ...); a tied
weight answers to each of its names. Param groups are not in a root (the built-in job's LR is a
function of the samples consumed): load `{"model": ..., "optim": {"state": ...}}` and keep the
optimizer's own groups. The iteration is the tracker's (a committed one), or `step=` if that one
is committed; a damaged block fails the load naming the file and block, as a resume would.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ..format import names, paths
from ...errors import CheckpointError
from ..format.plan import Piece, TensorSpec
from ..io.reader import Request, ShardReader
from ..root import root_for
from ..format.schema import Iteration, first_row, local_shape
from ..format.state import DTYPES

MODEL, OPTIM = "model", "optim"  # the state dict's top keys, as torchtitan's and DCP's docs write them


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Where DCP's chunk lies: `piece` of tensor `spec`, in shard file `file`."""

    file: str
    spec: TensorSpec
    piece: Piece

    @property
    def shape(self) -> tuple[int, ...]:
        return local_shape(self.spec, self.piece)

    @property
    def offset(self) -> tuple[int, ...]:
        return (first_row(self.spec, self.piece), *[0] * (len(self.spec.shape) - 1)) if self.spec.shape else ()


def dcp_name(kind: str, name: str) -> str | None:
    """The flattened `get_state_dict` name of our tensor `name` of `kind`; None for an optimizer's
    own tensor (MindFormers' `global_step`), which torch's optimizers do not keep."""
    if kind == paths.MODEL_KIND:
        return f"{MODEL}.{name}"
    param, slot = names.parse_state_name(name)
    return None if param is None else f"{OPTIM}.state.{param}.{slot}"


class Reader(StorageReader):
    """A committed iteration of the root `path` for `dcp.load` (local, NFS or `s3://`, with
    `storage` as `checkpoint.storage` takes it). `bytes_read`: what this rank read."""

    def __init__(self, path: str | os.PathLike, *, step: int | None = None, storage: dict | None = None):
        super().__init__()
        self.path, self.requested, self.options = os.fspath(path), step, storage
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.chunks: dict[MetadataIndex, Chunk] = {}
        self.iteration: Iteration | None = None
        self.step: int | None = None  # the iteration read, once chosen
        self.bytes_read = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return paths.parse_iteration_dirname(
            os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
        ) is not None or os.path.exists(paths.tracker_path(os.fspath(checkpoint_id)))

    def read_metadata(self, *args) -> Metadata:  # no **kwargs: DCP then asks no per-rank metadata after a failure
        """DCP's Metadata of the chosen iteration (every rank asks for it)."""
        it = self._open()
        state: dict[str, TensorStorageMetadata] = {}
        for kind, tensors in it.tensors.items():
            for name, stored in tensors.items():
                fqn = dcp_name(kind, name)
                if fqn is None:
                    continue
                chunks = [Chunk(file, stored.spec, piece) for file, piece in stored.pieces]
                state[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=DTYPES[stored.spec.dtype]),
                    size=torch.Size(stored.spec.shape),
                    chunks=[
                        ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)) for c in chunks
                    ],
                )
                self.chunks |= {MetadataIndex(fqn, c.offset): c for c in chunks}
        for alias, first in (it.ours.get("model") or {}).get("tied", {}).items():  # a tied weight, stored once
            if f"{MODEL}.{first}" in state:
                state[f"{MODEL}.{alias}"] = state[f"{MODEL}.{first}"]
                self.chunks |= {
                    MetadataIndex(f"{MODEL}.{alias}", index.offset): c
                    for index, c in self.chunks.items()
                    if index.fqn == f"{MODEL}.{first}"
                }
        return Metadata(
            state_dict_metadata=state,
            storage_data=dict(self.chunks),
            storage_meta=StorageMeta(checkpoint_id=it.path, load_id=uuid.uuid4().hex),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.chunks = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """The rows of each chunk the plan asks for, read from the checksum blocks they lie in (every
        block checked, and the header's), then copied into what the planner resolves each request to."""
        reader = ShardReader(self._root().storage, self.iteration)
        by_file: dict[str, list] = {}
        for item in plan.items:
            chunk = self.chunks[item.storage_index]
            first, rows = (item.storage_offsets[0], item.lengths[0]) if chunk.shape else (0, 1)
            start = chunk.piece.start + first * chunk.spec.row_numel
            rows_read = torch.empty(rows * chunk.spec.row_numel, dtype=DTYPES[chunk.spec.dtype])
            by_file.setdefault(chunk.file, []).append(
                (item, chunk, rows_read, Request(chunk.piece, chunk.spec, start, start + rows_read.numel(), rows_read))
            )
        for file, items in by_file.items():
            requests = [request for *_, request in items]
            spans = reader.spans(file, requests)
            needed = {0} | {
                i
                for i, (lo, hi, _) in enumerate(reader.blocks(file))
                if any(first < hi and lo < last for first, last, _ in spans)
            }
            reader.read_checked(file, requests, blocks=sorted(needed))
            for item, chunk, rows_read, _ in items:
                source = rows_read.view((item.lengths[0], *chunk.shape[1:]) if chunk.shape else ())
                for dim, (offset, length) in list(enumerate(zip(item.storage_offsets, item.lengths)))[1:]:
                    source = source.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                target.copy_(source)
                planner.commit_tensor(item, target)
        self.bytes_read += reader.bytes_read
        done = torch.futures.Future()
        done.set_result(None)
        return done

    def _root(self):
        root, _ = _split(self.path)
        return root_for(root, self.options)

    def _open(self) -> Iteration:
        """The iteration to read: the one asked for (or the path's) if committed, else the tracker's,
        which rank 0 reads for every rank of the default process group (a job committing beside the
        load moves it; with DCP on another group, name the iteration)."""
        root, step = _split(self.path)
        step = self.requested if self.requested is not None else step
        committed = self._root().committed()
        if step is None and dist.is_initialized() and dist.get_world_size() > 1:
            chosen = [committed]
            dist.broadcast_object_list(chosen, src=0)
            committed = chosen[0]
        if committed is None:
            raise CheckpointError(f"{paths.tracker_path(root)}: no committed iteration to read (no tracker)")
        if step is not None and step > committed:
            raise CheckpointError(
                f"{paths.iteration_dir(root, step)}: iteration {step} is not committed (the tracker names "
                f"{committed}); read {committed} or an older one"
            )
        self.step = committed if step is None else step
        self.iteration = self._root().iteration(self.step)
        return self.iteration


def _split(path: str) -> tuple[str, int | None]:
    """(root, step) of a root or of one of its iteration directories."""
    step = paths.parse_iteration_dirname(os.path.basename(path.rstrip("/")))
    return (os.path.dirname(path.rstrip("/")), step) if step is not None else (path, None)
