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

from .format import names, paths
from .format.manifest import Manifest
from .format.parse import parse_iteration
from .format.schema import CKPT_NORMAL, COMMON_FIELDS, FILE_FIELDS, LAYOUT_ALIAS, dumps, shard_id


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
            raise RuntimeError(
                f"manifest {rank} is from rank {manifest.rank} of {manifest.world_size}, expected rank {rank} of {world}"
            )
    iter_dir = paths.iteration_dir(root, iteration)
    reported = {name: (manifest.rank, info.size) for manifest in manifests for name, info in manifest.files.items()}
    on_storage = storage.sizes(iter_dir, list(reported))
    for name, (rank, size) in reported.items():
        if on_storage[name] != size:
            raise RuntimeError(f"rank {rank} reported {name} with {size} bytes, storage has {on_storage[name]}")
    common, ours = split_common(common)
    metadata = build_metadata(iteration, prefix, manifests, {**ours, "job_id": job_id, "saved_at": time.time()})
    # refuse to commit what a reader would refuse
    parse_iteration({"common": common, "metadata": metadata}, root, iteration)
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


def split_common(reported: dict) -> tuple[dict, dict]:
    """Rank 0's account of a save into common.json (CommonInfo's fields, ckpt_status normal) and what
    is ours alone (for metadata.json's `ray_resume`)."""
    common = {key: reported[key] for key in COMMON_FIELDS if key != "ckpt_status"}
    common["loss_scale"] = float(common["loss_scale"])
    common["ckpt_status"] = CKPT_NORMAL
    return common, {k: v for k, v in reported.items() if k not in COMMON_FIELDS}


def build_metadata(iteration: int, prefix: str, manifests: list[Manifest], facts: dict) -> dict:
    """metadata.json from every rank's manifest (ordered by rank): MindFormers' schema for every tensor
    and chunk, and ours (the files and their digests, `facts`) under `ray_resume`."""
    world = len(manifests)
    files, chunks = {}, {}
    for manifest in manifests:
        for name, info in manifest.files.items():
            files[name] = {k: getattr(info, k) for k in FILE_FIELDS}
        for kind, held in manifest.chunks.items():
            file = paths.shard_filename(prefix, kind, manifest.rank, world)
            for name, first, rows in held:
                chunks.setdefault(name, []).append((first, rows, manifest.rank, file))
    state, storage = {}, {}
    for kind, specs in manifests[0].specs.items():
        for name, dtype, shape in specs:
            parts = sorted(chunks.get(name, []))
            cut = len(parts) > 1 and len({rows for _, rows, _, _ in parts}) == 1
            state[name] = {
                "properties": {
                    "dtype": names.mindspore_dtype(dtype),
                    "replica_id": 0,
                    "allow_shape_mismatch": False,
                    "allow_to_save": True,
                },
                "global_shape": shape,
                "axis_fragmentations": [len(parts)] + [1] * (len(shape) - 1) if shape else [],
                "layout": {
                    "device_matrix": [len(parts)],
                    "tensor_map": [0] + [-1] * (len(shape) - 1),
                    "interleaved_parallel": False,
                    "alias_name": [LAYOUT_ALIAS],
                    "rank_list": [rank for _, _, rank, _ in parts],
                }
                if cut
                else None,
                "chunk": [],
            }
            for first, rows, rank, file in parts:
                offset = [first] + [0] * (len(shape) - 1) if shape else []
                state[name]["chunk"].append(
                    {"global_offset": offset, "local_shape": [rows, *shape[1:]] if shape else []}
                )
                storage[shard_id(name, offset)] = [{"file_name": file, "storage_rank": rank, "rank_group": [rank]}]
    model = {"model": manifests[0].model} if manifests[0].model else {}  # rank 0's state.export_facts
    return {
        "state_dict_metadata": state,
        "storage_data": storage,
        "ray_resume": {
            "format_version": paths.FORMAT_VERSION,
            "iteration": iteration,
            "world_size": world,
            "prefix": prefix,
            "block_size": manifests[0].block_size,
            "files": files,
            **model,
            **facts,
        },
    }
