"""What a root holds, read from its metadata alone: the tracker, the iterations there, the one
committed, an iteration's JSON (and the safetensors headers of one MindFormers wrote). No tensor
is read here and nothing is written; no torch either, so the job's controller, its lease and the
CLI's listings use it without loading torch (tensors: reader.py)."""

from __future__ import annotations

import struct

from ...errors import CheckpointError
from ..format import paths
from ..format.parse import parse_iteration
from ..format.schema import MAX_HEADER, Iteration, parse_json
from .storage import Storage


def read_tracker(storage: Storage, root: str) -> int | None:
    """The step the tracker names, None when there is no tracker; errors name the file."""
    path = paths.tracker_path(root)
    if not storage.exists(path):
        return None
    text = storage.read_bytes(path).decode(errors="replace").strip()
    if not text:
        raise CheckpointError(
            f"{path}: tracker is empty; write the newest complete iteration number into it or remove it"
        )
    if not text.isdigit():
        raise CheckpointError(f"{path}: tracker must hold a non-negative iteration number, got {text[:40]!r}")
    return int(text)


def find_committed(storage: Storage, root: str) -> int | None:
    """The newest committed iteration under `root`, or None when nothing was committed."""
    if not storage.is_dir(root):
        raise CheckpointError(f"checkpoint.load_path {root!r} does not exist or is not a directory")
    step = read_tracker(storage, root)
    if step is not None and not storage.is_dir(paths.iteration_dir(root, step)):
        raise CheckpointError(
            f"{paths.tracker_path(root)}: names iteration {step}, but {paths.iteration_dirname(step)}/ does not exist"
        )
    return step


def open_iteration(storage: Storage, root: str, step: int) -> Iteration:
    """The iteration's JSON files read and checked (and, for one MindFormers wrote, its shards'
    safetensors headers): O(metadata), no shard byte beyond the headers."""
    path = paths.iteration_dir(root, step)
    raw = {}
    for key, name in (("common", paths.COMMON), ("metadata", paths.METADATA)):
        file = paths.join(path, name)
        raw[key] = parse_json(storage.read_bytes(file), file) if storage.exists(file) else None
    if raw["common"] is None:
        raise CheckpointError(
            f"{paths.join(path, paths.COMMON)}: missing; iteration {step} was never committed or was damaged"
        )
    ours = raw["metadata"] is not None and ("ray_resume" in raw["metadata"] or "format_version" in raw["metadata"])
    if not ours:  # written by MindFormers: its shards are described by their headers
        raw["headers"] = read_headers(storage, path)
        if raw["metadata"] is None and any(paths.parse_shard_filename(n)["world"] != 1 for n in raw["headers"]):
            raise CheckpointError(
                f"{paths.join(path, paths.METADATA)}: missing; iteration {step} was never committed or was "
                "damaged (only a one-card MindFormers checkpoint goes without it)"
            )
    return parse_iteration(raw, root, step)


def read_headers(storage: Storage, directory: str) -> dict[str, dict]:
    """{shard file: {"size", "data_start", "header"}} of every shard file in `directory`."""
    out = {}
    for name in storage.listdir(directory):
        if paths.parse_shard_filename(name) is None:
            continue
        file = paths.join(directory, name)
        data_start, header = read_header(storage, file)
        out[name] = {"size": storage.size(file), "data_start": data_start, "header": header}
    return out


def check_no_extra_shards(storage: Storage, it: Iteration) -> None:
    """No shard file of ours beside the ones the commit listed (a leftover of another world size or attempt).
    MindFormers' iterations may hold copies its metadata does not pick: they are its own."""
    if it.origin != "ray_resume":
        return
    for name in storage.listdir(it.path):
        if paths.parse_shard_filename(name) and name not in it.files:
            raise CheckpointError(
                f"{paths.join(it.path, name)}: shard file not listed in metadata.json; remove it or restore the matching metadata.json"
            )


def iteration_steps(storage: Storage, root: str) -> list[int]:
    """Steps of every `iteration_XXXXXXXX` directory under `root`, ascending."""
    steps = []
    for name in storage.listdir(root):
        step = paths.parse_iteration_dirname(name)
        if step is not None and storage.is_dir(paths.join(root, name)):
            steps.append(step)
    return sorted(steps)


def read_header(storage: Storage, file: str) -> tuple[int, dict]:
    """The start of a safetensors file's data section, and its header, read and checked."""
    size = storage.size(file)
    if size is None or size < 8:
        raise CheckpointError(f"{file}: not a valid safetensors file ({size} bytes, no room for its header's length)")
    (length,) = struct.unpack("<Q", storage.read_range(file, 0, 8))
    if not 8 + length <= size or length > MAX_HEADER:
        raise CheckpointError(f"{file}: not a valid safetensors file ({size} bytes, a header of {length})")
    return 8 + length, parse_json(storage.read_range(file, 8, length), file)


def resume_step(common: dict, gbs: int | None) -> tuple[int, str | None]:
    """The step to continue from after an iteration whose common.json is `common`, at global batch size
    `gbs` (None: the saved one), and how it was rescaled (a line for the log; None when it was not).

    Spec 1.4: resume_step = saved_step x saved_gbs / current_gbs keeps the consumed samples equal. When that
    is not a whole number the step is rounded down, but the data cursor stays at the exact consumed-sample
    count, so no sample is skipped or repeated."""
    saved_gbs, consumed = common["global_batch_size"], common["consumed_samples"]
    if gbs is None or saved_gbs in (None, gbs) or consumed is None:  # nothing to rescale, or nothing to rescale by
        return common["global_step"], None
    step, leftover = divmod(consumed, gbs)
    rounded = f", rounded down to {step}" if leftover else ""
    return step, (
        f"global_batch_size changed {saved_gbs} -> {gbs}: resume step = {common['global_step']} x {saved_gbs} / {gbs} "
        f"= {consumed / gbs:g}{rounded}; data continues at sample {consumed}"
    )
