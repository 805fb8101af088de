"""A DCP checkpoint (torchtitan's `step-N/`, or any `dcp.save`'s) as a `checkpoint.load_path` a job
resumes: found, its `.metadata` read (unpickled with only DCP's own classes allowed), its weights'
and optimizer's specs for the driver's checks, and loaded by DCP's own planner into the live state
(`load_dcp`): the weights, and Adam's state and `train_state.step` where it holds them.

The other way, a ray_resume root read by `dcp.load`, is `dcp.Reader`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import (
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ..format import names, paths
from ...errors import CheckpointError
from ..format.plan import TensorSpec
from ..format.state import DTYPE_TAGS

from .dcp import MODEL, OPTIM

DCP_METADATA = ".metadata"  # what `dcp.save` writes beside its `__R_I.distcp` files
STEP_DIR = re.compile(r"^step-(\d+)$")  # torchtitan's checkpoint directories
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def dcp_checkpoint(path: str) -> str | None:
    """The DCP checkpoint `path` names: itself when it holds `.metadata`, else the newest of its
    torchtitan `step-N/` directories that does; None when neither (or not on a local file system)."""
    if paths.on_object_storage(path):
        return None
    path = paths.local_path(path)
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return path
    steps = sorted(
        int(m[1])
        for n in (os.listdir(path) if os.path.isdir(path) else ())
        if (m := STEP_DIR.match(n)) and os.path.isfile(os.path.join(path, n, DCP_METADATA))
    )
    return os.path.join(path, f"step-{steps[-1]}") if steps else None


class _MetadataUnpickler(pickle.Unpickler):
    """torch writes `.metadata` with pickle, which can run any code a file names: this one builds
    DCP's own metadata classes, torch's sizes, dtypes and layouts, and refuses anything else."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.where}: refers to {module}.{name}, which DCP's metadata never holds; not read "
            "(unpickling it could run code): this is not a checkpoint torch.distributed.checkpoint wrote"
        )


def read_dcp_metadata(path: str) -> Metadata:
    """The `Metadata` of the DCP checkpoint directory `path`, unpickled by `_MetadataUnpickler` once per
    process for a file as it is (a job's driver and ranks ask several times; torchtitan's can be tens of
    MB). Shared: not to be changed."""
    where = os.path.join(path, DCP_METADATA)
    try:
        stat = os.stat(where)
    except OSError as exc:
        raise CheckpointError(f"{where}: not a DCP metadata file ({exc})") from None
    return _unpickled(where, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _unpickled(where: str, mtime_ns: int, size: int) -> Metadata:
    """`read_dcp_metadata`'s reading, keyed by the file's time and size so that a rewritten file is read again."""
    try:
        with open(where, "rb") as f:
            metadata = _MetadataUnpickler(f, where).load()
    except CheckpointError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: not a DCP metadata file ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


TRAIN_STATE_STEP = "train_state.step"  # torchtitan's TrainState: the step the checkpoint was taken after


# The top keys of a state dict that are not the model's, as torchtitan and DCP's docs name them.
NOT_MODEL = ("optimizer", OPTIM, "lr_scheduler", "dataloader", "train_state")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a DCP checkpoint keeps the model and the optimizer: `model.{name}` (torchtitan until
    2025, DCP's docs) or the model's names at the top (torchtitan since, and its weights-only
    last step); `optimizer.state.{param}.{slot}` (torchtitan's flattened optimizer state) or
    `optim.state.{param}.{slot}` (`get_state_dict` under "optim")."""

    model: str  # "model." or ""
    optimizer: str  # "optimizer" or "optim"


def layout(metadata: Metadata) -> Layout:
    keys = metadata.state_dict_metadata
    model = f"{MODEL}." if any(k.startswith(f"{MODEL}.") for k in keys) else ""
    return Layout(model, "optimizer" if any(k.startswith("optimizer.state.") for k in keys) else OPTIM)


def weight_specs(path: str, metadata: Metadata | None = None) -> dict[str, TensorSpec]:
    """The model tensors of the DCP checkpoint at `path` (`Layout`), as our specs, by name."""
    metadata = metadata or read_dcp_metadata(path)
    prefix = layout(metadata).model
    out = {
        name: spec for name, spec in _specs(metadata, prefix).items() if prefix or name.split(".")[0] not in NOT_MODEL
    }
    if not out:
        raise CheckpointError(
            f"{path}: holds no model tensor; ray_resume reads what torchtitan saves, the model's "
            f"state dict under {MODEL!r} or at the top"
        )
    return out


def optimizer_specs(path: str, metadata: Metadata | None = None) -> dict[str, TensorSpec]:
    """The optimizer's tensors (`{optimizer}.state.{param}.{slot}`), under our names (`names.state_name`)."""
    metadata = metadata or read_dcp_metadata(path)
    out = {}
    for fqn, spec in _specs(metadata, f"{layout(metadata).optimizer}.state.").items():
        param, _, slot = fqn.rpartition(".")
        out[names.state_name(param, slot)] = dataclasses.replace(spec, name=names.state_name(param, slot))
    return out


def holds_step(metadata: Metadata) -> bool:
    """Whether the checkpoint says its step: `train_state.step`, a 0-d integer (torchtitan's TrainState)."""
    step = metadata.state_dict_metadata.get(TRAIN_STATE_STEP)
    return (
        isinstance(step, TensorStorageMetadata) and not len(step.size) and not step.properties.dtype.is_floating_point
    )


def full_resume_problem(path: str, step_given: bool = False) -> str | None:
    """Why the DCP checkpoint at `path` cannot be resumed whole (optimizer, step, data cursor); None if it
    can. `step_given`: the loop says the step itself (`restore(..., step=)`)."""
    metadata = read_dcp_metadata(path)
    if not step_given and not holds_step(metadata):
        return f"it holds no {TRAIN_STATE_STEP} (an integer, as torchtitan's TrainState saves it), so the step it was taken at is unknown"
    if not optimizer_specs(path, metadata):
        return "it holds no optimizer state (optimizer.state.* or optim.state.*)"
    return None


def _specs(metadata: Metadata, prefix: str) -> dict[str, TensorSpec]:
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            name = fqn[len(prefix) :]
            out[name] = TensorSpec(
                name,
                DTYPE_TAGS.get(md.properties.dtype, str(md.properties.dtype)),
                tuple(md.size),
                md.properties.dtype.itemsize,
            )
    return out


class DcpReader(FileSystemReader):
    """DCP's own reader of a checkpoint directory, its `.metadata` through `read_dcp_metadata`
    (its tensors are read as DCP reads them: `torch.load(weights_only=True)`, torch's restricted
    loader). `bytes_read`: the stored bytes of the items this rank read."""

    def __init__(self, path: str):
        super().__init__(path)
        self.dcp_path, self.bytes_read = path, 0

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(self.dcp_path)  # shared: this load's id goes on a copy
        return dataclasses.replace(
            metadata, storage_meta=dataclasses.replace(metadata.storage_meta or StorageMeta(), load_id=self.load_id)
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        self.bytes_read += sum(self.storage_data[index].length for index in {item.storage_index for item in plan.items})
        return super().read_data(plan, planner)


def load_dcp(
    path: str, live: dict[str, torch.Tensor], slots: dict[str, torch.Tensor] | None = None
) -> tuple[int, int | None]:
    """Fill the model's tensors `live` (plain, or this rank's DTensor shards), and the optimizer
    `slots` given (named as `names.state_name` names them, shaped like their parameters), from the
    DCP checkpoint at `path`, in place, resharded by DCP's planner; (bytes this rank read, the
    checkpoint's `train_state.step` when slots were asked for and it holds one, else None)."""
    metadata = read_dcp_metadata(path)
    where = layout(metadata)
    wanted: dict = {MODEL: live} if where.model else dict(live)
    step = torch.zeros((), dtype=torch.int64) if slots is not None and holds_step(metadata) else None
    if slots is not None:
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in slots.items():
            param, slot = names.parse_state_name(name)
            by_param.setdefault(param, {})[slot] = t
        wanted[where.optimizer] = {"state": by_param}
    if step is not None:
        wanted["train_state"] = {"step": step}
    reader = DcpReader(path)
    try:
        dcp.load(wanted, storage_reader=reader)
    # DCP's CheckpointException (a BaseException) or its AssertionError, of what a rank met
    except BaseException as exc:
        if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
            raise
        why = next((line.strip() for line in reversed(str(exc).splitlines()) if line.strip()), type(exc).__name__)
        raise CheckpointError(
            f"{path}: torch.distributed.checkpoint could not load it ({why}); "
            f"`ray-resume verify {path}` checks its files"
        ) from None
    return reader.bytes_read, (None if step is None else int(step))


def describe(path: str) -> dict:
    """What `ray-resume show` and `verify` say of the DCP checkpoint at `path`: its tensors, its other
    entries, its files, and what does not hold (a file missing, or shorter than an item it holds).
    DCP keeps no digests: its bytes themselves cannot be checked."""
    metadata = read_dcp_metadata(path)
    tensors = {
        fqn: {
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "shape": list(md.size),
            "chunks": len(md.chunks),
        }
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    files, problems = {}, []
    for index, info in metadata.storage_data.items():
        name = str(info.relative_path)
        file = os.path.join(path, name)
        if name not in files:
            files[name] = {"size": os.path.getsize(file) if os.path.isfile(file) else None, "items": 0}
        files[name]["items"] += 1
        size = files[name]["size"]
        if size is None or info.offset + info.length > size:
            problems.append(
                f"{file}: {'missing' if size is None else f'{size} bytes'}, but {index.fqn} is stored at bytes "
                f"{info.offset}-{info.offset + info.length}"
            )
    return {
        "path": path,
        "tensors": tensors,
        "other": sorted(set(metadata.state_dict_metadata) - set(tensors)),
        "files": files,
        "problems": problems,
        "ok": not problems,
    }
