"""The commit: the only writer of metadata.json, common.json and the tracker.

`commit_iteration` is a plain function of storage and every rank's manifest;
the job's controller (`ray_resume.controller`) calls it on the driver once
all ranks of an iteration have reported, and `benchmarks/scale_sim.py` runs
it for 16,384 ranks. It costs O(ranks + tensors): one size check per file
(on object storage, one LIST page per 1,000 files instead of one HEAD per
file), then four small atomic writes, the tracker last (invariant 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import yaml

from . import paths
from .manifest import Manifest
from .parse import parse_iteration
from .schema import build_metadata, dumps, split_common


def commit_iteration(
    storage,
    root: str,
    iteration: int,
    manifests: list[Manifest],
    common: dict,
    *,
    prefix: str,
    config: dict,
    job_id: str,
    fence: Callable[[], None] = lambda: None,
    before_tracker: Callable[[], None] = lambda: None,
) -> dict:
    """Commit `iteration` from every rank's manifest (`manifests[r]` is rank r's); return its metadata.

    Checks that every reported file is on storage with its reported size and
    that the iteration reads back as a reader reads it (every rank's shard of
    every kind, every tensor's chunks tiling it), calls `fence` (raises if this
    job lost the writer lease), removes every other file of the directory
    (`remove_unlisted`), then writes metadata.json, config.yaml and
    common.json (rank 0's `common`: MindFormers' CommonInfo there, the rest of
    it, with the job and the time, in metadata.json's `ray_resume`), calls
    `before_tracker` (fault injection) and `fence` again, and moves the tracker
    last. Raises on any mismatch, before the tracker moves.
    """
    world = len(manifests)
    for rank, manifest in enumerate(manifests):
        if manifest.rank != rank or manifest.world_size != world:
            raise RuntimeError(f"manifest {rank} is from rank {manifest.rank} of {manifest.world_size}, expected rank {rank} of {world}")
    iter_dir = paths.iteration_dir(root, iteration)
    reported = {name: (manifest.rank, info.size) for manifest in manifests for name, info in manifest.files.items()}
    on_storage = storage.sizes(iter_dir, list(reported))
    for name, (rank, size) in reported.items():
        if on_storage[name] != size:
            raise RuntimeError(f"rank {rank} reported {name} with {size} bytes, storage has {on_storage[name]}")
    common, ours = split_common(common)
    metadata = build_metadata(iteration, prefix, manifests, {**ours, "job_id": job_id, "saved_at": time.time()})
    parse_iteration({"common": common, "metadata": metadata}, root, iteration)  # refuse to commit what a reader would refuse
    fence()
    remove_unlisted(storage, iter_dir, set(reported))
    storage.write_atomic(paths.join(iter_dir, paths.METADATA), dumps(metadata))
    storage.write_atomic(paths.join(iter_dir, paths.CONFIG), yaml.safe_dump(config, sort_keys=False).encode())
    storage.write_atomic(paths.join(iter_dir, paths.COMMON), dumps(common))
    before_tracker()
    fence()
    storage.write_atomic(paths.tracker_path(root), f"{iteration}\n".encode())
    return metadata


def remove_unlisted(storage, iter_dir: str, listed: set[str]) -> None:
    """Remove every file of `iter_dir` but `listed`: what an iteration holds is what its commit lists.

    A re-save of an iteration (a new attempt, after a crash mid-save) may run
    on fewer ranks than the attempt that died, whose shards of the larger world
    size would otherwise outlive the commit, and every later load would refuse
    the iteration for them. A common.json left by an earlier, unfinished commit
    goes first: until the new one is written the directory never passes as
    committed, wherever a crash cuts this short.
    """
    stale = [name for name in storage.listdir(iter_dir) if name not in listed]
    for name in sorted(stale, key=lambda name: name != paths.COMMON):
        storage.remove(paths.join(iter_dir, name))
