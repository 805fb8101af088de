"""A checkpoint root as one object: its URI, its storage, its writer lease, its iterations; and
what a job resumes from, as one typed value.

`root_for(uri, options)` builds a root's storage once per process (the
driver, the controller, each rank) and hands the same object to everything
in that process that reads or writes the root.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from . import paths
from .fallback import select_iteration
from .lease import Lease
from .reader import export_specs, find_committed, is_export, open_iteration
from .schema import Iteration
from .storage import storage_for


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
    `step-N/`): its weights, and with a full load Adam's state and `train_state.step` (`checkpoint.dcp`)."""

    path: str


ResumeSource = CommittedIteration | WeightsExport | DcpCheckpoint


class CheckpointRoot:
    def __init__(self, uri: str, options=None):
        self.uri = uri
        self.storage = storage_for(uri, options)

    def exists(self) -> bool:
        return self.storage.is_dir(self.uri)

    def committed(self) -> int | None:
        """The step the tracker names (checked to exist), None when nothing was committed."""
        return find_committed(self.storage, self.uri)

    def select(self, *, fallback: bool) -> int | None:
        """The iteration to resume: the tracker's if it checks out, else the newest older one that
        does (the damaged one set aside, unless `fallback` is off); None when nothing was committed."""
        return select_iteration(self.storage, self.uri, fallback=fallback)

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
