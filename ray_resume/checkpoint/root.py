"""A checkpoint root as one object: its URI, its storage, its writer lease, its iterations; and
what a job resumes from, as one typed value.

`root_for(uri, options)` builds a root's storage once per process (the
driver, the controller, each rank) and hands the same object to everything
in that process that reads or writes the root.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass

from .format import paths
from .io.lease import Lease
from .interop.export import export_specs, is_export
from .io.iterations import find_committed, iteration_steps, open_iteration, read_tracker
from .format.schema import Iteration
from .io.storage import Storage, storage_for


@dataclass(frozen=True)
class CommittedIteration:
    """Resume from iteration `step` of the checkpoint root `root`: weights, and with a full load
    the optimizer, RNG, step and data cursor too."""

    root: str
    step: int

    @property
    def path(self) -> str:
        return paths.iteration_dir(self.root, self.step)


@dataclass(frozen=True)
class WeightsExport:
    """Start from the weights of a consolidated safetensors export (`ray-resume export`, Hugging Face)."""

    path: str


@dataclass(frozen=True)
class DcpCheckpoint:
    """Resume from a torch.distributed.checkpoint directory (`.metadata`, `.distcp` files; torchtitan's
    `step-N/`): its weights, and with a full load Adam's state and `train_state.step` (`interop.dcp_checkpoint`)."""

    path: str


ResumeSource = CommittedIteration | WeightsExport | DcpCheckpoint
_SOURCES = {"committed": CommittedIteration, "export": WeightsExport, "dcp": DcpCheckpoint}


@dataclass(frozen=True)
class ResumePlan:
    """What one worker-group start resumes, decided once for all its ranks, which carry it out: the
    driver decides the first start's (`checkpoint.load_path`, checked under the writer lease), the
    controller every restart's (`JobController.start_attempt`: this job's newest commit, else the
    first start's source; and a newer memory snapshot). Only damage found in shard bytes while they
    load changes it, and rank 0 decides that for every rank (`Checkpointer.restore`)."""

    source: ResumeSource | None = None  # None: from scratch, at step 0
    full: bool = False  # the optimizer, RNG streams, step and data cursor too; else the weights only
    memory_step: int | None = None  # a newer step every rank holds in memory: tried first, `source` where it is gone

    @classmethod
    def first(cls, source: ResumeSource | None, no_load_optim: bool) -> "ResumePlan":
        """The first start's: `source` whole, unless no_load_optim (an export holds weights only)."""
        return cls(source, full=isinstance(source, (CommittedIteration, DcpCheckpoint)) and not no_load_optim)

    def restart(self, save_path: str, committed: int | None, memory_step: int | None) -> "ResumePlan":
        """A restart's, after this (the first start's) plan: the job's own newest commit, always whole."""
        if committed is not None:
            return ResumePlan(CommittedIteration(save_path, committed), full=True, memory_step=memory_step)
        return ResumePlan(self.source, self.full, memory_step)

    def to_json(self) -> dict:
        source = None
        if self.source is not None:  # one of ResumeSource's kinds, or a bug: never "nothing" by mistake
            kind = next(k for k, cls in _SOURCES.items() if type(self.source) is cls)
            source = {"kind": kind, **dataclasses.asdict(self.source)}
        return {"source": source, "full": self.full, "memory_step": self.memory_step}

    @classmethod
    def from_json(cls, data: dict) -> "ResumePlan":
        source = data["source"]
        if source is not None:
            source = _SOURCES[source["kind"]](**{k: v for k, v in source.items() if k != "kind"})
        return cls(source, bool(data["full"]), data["memory_step"])


class CheckpointRoot:
    """A root, by its URI, and the storage that reaches it: what is passed around above the reader's and
    writer's functions (which take the two apart). `root_for` makes one per root and process; `storage`
    is given where a test watches the calls."""

    def __init__(self, uri: str, options=None, *, storage: Storage | None = None):
        self.uri = uri
        self.storage = storage if storage is not None else storage_for(uri, options)

    def exists(self) -> bool:
        return self.storage.is_dir(self.uri)

    def committed(self) -> int | None:
        """The step the tracker names (checked to exist), None when nothing was committed."""
        return find_committed(self.storage, self.uri)

    def tracker(self) -> int | None:
        """The step the tracker names, as written (None: no tracker); a garbled one is a CheckpointError."""
        return read_tracker(self.storage, self.uri)

    def steps(self) -> list[int]:
        """The steps of the iteration directories here, ascending."""
        return iteration_steps(self.storage, self.uri)

    def iteration(self, step: int) -> Iteration:
        """Iteration `step`'s JSON files, read and checked."""
        return open_iteration(self.storage, self.uri, step)

    def is_export(self) -> bool:
        return is_export(self.storage, self.uri)

    def export_specs(self) -> dict:
        return export_specs(self.storage, self.uri)

    def lease(self, job_id: str, ttl_s: float) -> Lease:
        """Job `job_id`'s writer lease on this root (to take, renew and release, or to fence commits with)."""
        return Lease(self.storage, self.uri, job_id, ttl_s)

    def iteration_dir(self, step: int) -> str:
        return paths.iteration_dir(self.uri, step)


_roots: dict[tuple[str, str], CheckpointRoot] = {}
_lock = threading.Lock()


def root_for(uri: str, options=None) -> CheckpointRoot:
    """This process's CheckpointRoot of `uri` with storage `options` (a config.StorageConfig, a dict
    of its keys, or None: the environment's credentials)."""
    if hasattr(options, "model_dump"):
        options = options.model_dump()
    key = (uri, json.dumps(options or {}, sort_keys=True))
    with _lock:
        if key not in _roots:
            _roots[key] = CheckpointRoot(uri, options)
        return _roots[key]
