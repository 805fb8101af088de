"""Per-rank shard writing: this rank's share of the model and optimizer state.

Each rank computes the same save plan from the same tensor list and writes
only its own share, so no byte is written twice (replicated DDP state) and
every rank does 1/W of the work. The returned manifest is what the driver
needs to commit: file sizes and checksums, and which pieces went where.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import safetensors.torch
import torch

from . import layout
from .plan import TensorSpec, split_replicated
from .schema import DTYPE_TAGS
from .storage import LocalStorage

logger = logging.getLogger(__name__)

RANK_EXTRAS_KEY = "rank_extras"


def tensor_specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """Specs in the state's own (deterministic) key order."""
    return [TensorSpec(name, DTYPE_TAGS[t.dtype], tuple(t.shape), t.element_size()) for name, t in state.items()]


def save_shards(
    storage: LocalStorage,
    root: str,
    step: int,
    *,
    prefix: str,
    rank: int,
    world_size: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, torch.Tensor] | None,
    rank_extras: dict[str, str],
    on_mid_write: Callable[[], None] = lambda: None,
) -> dict:
    """Write this rank's shard files of iteration `step`; return its manifest.

    `rank_extras` (RNG states, as strings) go into the opt shard's safetensors
    header: they belong to this rank and to the optimizer-resume path only.
    """
    iter_dir = layout.iteration_dir(root, step)
    storage.makedirs(iter_dir)
    if rank == 0:
        # A crash may have left this (uncommitted) iteration half written by an
        # earlier attempt. Its JSON must not describe the shards we write now.
        for name in (layout.METADATA, layout.COMMON):
            storage.remove(layout.join(iter_dir, name))
    manifest: dict = {"rank": rank, "world_size": world_size, "files": {}, "pieces": {}, "specs": {}}
    kinds = [(layout.MODEL_KIND, model_state, None)]
    if optim_state is not None:
        # One header key: safetensors writes header maps in hash order, and a
        # single entry keeps the file bytes reproducible (exact-resume tests
        # compare bytes).
        kinds.append((layout.OPTIM_KIND, optim_state, {RANK_EXTRAS_KEY: json.dumps(rank_extras, sort_keys=True)}))
    for kind, state, header in kinds:
        specs = tensor_specs(state)
        share = split_replicated(specs, world_size)[rank]
        # clone(): a snapshot that owns its memory (safetensors refuses shared storage).
        tensors = {p.name: state[p.name].detach().reshape(-1)[p.start : p.start + p.numel].clone() for p in share}
        data = safetensors.torch.save(tensors, metadata=header)
        name = layout.shard_filename(prefix, kind, rank, world_size)
        size, sha256 = storage.write_durable(layout.join(iter_dir, name), _halves(data, on_mid_write))
        manifest["files"][name] = {"size": size, "sha256": sha256, "kind": kind, "rank": rank}
        manifest["pieces"][kind] = [[p.name, p.start, p.numel, name] for p in share]
        if rank == 0:
            manifest["specs"][kind] = [[s.name, s.dtype, list(s.shape)] for s in specs]
    logger.debug("rank %d wrote %s", rank, json.dumps(manifest["files"]))
    return manifest


def _halves(data: bytes, between: Callable[[], None]) -> Iterator[bytes]:
    """The file's bytes in two writes, with a hook between them (fault injection)."""
    half = len(data) // 2
    yield data[:half]
    between()
    yield data[half:]
