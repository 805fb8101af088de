"""Find, verify and load a committed iteration.

Order matters: the tracker names an iteration, its JSON is validated, every
file it lists is checked for size and sha256, and only then is any tensor
built. Nothing here writes, so a failed load leaves storage as it was.
Shards are parsed by safetensors (no pickle).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

import safetensors.torch
import torch

from . import layout
from .schema import DTYPES, CheckpointError, parse_json, validate_common, validate_metadata
from .storage import LocalStorage
from .writer import RANK_EXTRAS_KEY

logger = logging.getLogger(__name__)


@dataclass
class Iteration:
    """A validated iteration: where it is, and its two JSON files."""

    root: str
    step: int
    path: str
    common: dict
    metadata: dict


def read_tracker(storage: LocalStorage, root: str) -> int | None:
    """The step the tracker names, None when there is no tracker; errors name the file."""
    path = layout.tracker_path(root)
    if not storage.exists(path):
        return None
    text = storage.read_bytes(path).decode(errors="replace").strip()
    if not text:
        raise CheckpointError(f"{path}: tracker is empty; write the newest complete iteration number into it or remove it")
    if not text.isdigit():
        raise CheckpointError(f"{path}: tracker must hold a non-negative iteration number, got {text[:40]!r}")
    return int(text)


def find_committed(storage: LocalStorage, root: str) -> int | None:
    """The newest committed iteration under `root`, or None when nothing was committed."""
    if not storage.is_dir(root):
        raise CheckpointError(f"checkpoint.load_path {root!r} does not exist or is not a directory")
    step = read_tracker(storage, root)
    if step is not None and not storage.is_dir(layout.iteration_dir(root, step)):
        raise CheckpointError(
            f"{layout.tracker_path(root)}: names iteration {step}, but {layout.iteration_dirname(step)}/ does not exist"
        )
    return step


def open_iteration(storage: LocalStorage, root: str, step: int) -> Iteration:
    path = layout.iteration_dir(root, step)
    docs = {}
    for name in (layout.COMMON, layout.METADATA):
        file = layout.join(path, name)
        if not storage.exists(file):
            raise CheckpointError(f"{file}: missing; iteration {step} was never committed or was damaged")
        docs[name] = parse_json(storage.read_bytes(file), file)
    validate_common(docs[layout.COMMON], layout.join(path, layout.COMMON))
    validate_metadata(docs[layout.METADATA], layout.join(path, layout.METADATA))
    return Iteration(root, step, path, docs[layout.COMMON], docs[layout.METADATA])


def read_verified(storage: LocalStorage, it: Iteration, names: list[str]) -> dict[str, bytes]:
    """Read whole files, each checked against the size and sha256 in metadata.json."""
    out = {}
    for name in names:
        expected = it.metadata["files"][name]
        path = layout.join(it.path, name)
        size = storage.size(path)
        if size is None:
            raise CheckpointError(f"{path}: shard listed in metadata.json is missing")
        if size != expected["size"]:
            raise CheckpointError(f"{path}: size is {size} bytes, metadata.json says {expected['size']}; the shard is truncated or replaced")
        data = storage.read_bytes(path)
        if hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointError(f"{path}: sha256 does not match metadata.json; the shard is corrupt")
        out[name] = data
    return out


def check_no_extra_shards(storage: LocalStorage, it: Iteration) -> None:
    listed = set(it.metadata["files"])
    for name in storage.listdir(it.path):
        if layout.parse_shard_filename(name) and name not in listed:
            raise CheckpointError(f"{layout.join(it.path, name)}: shard file not listed in metadata.json; remove it or restore the matching metadata.json")


def shard_header(data: bytes, where: str) -> dict:
    """The JSON header of a safetensors file (its `__metadata__` holds our per-rank extras)."""
    if len(data) < 8:
        raise CheckpointError(f"{where}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise CheckpointError(f"{where}: safetensors header length {length} exceeds the file")
    return parse_json(data[8 : 8 + length], where)


def _parse_shard(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own error type for lying headers
        raise CheckpointError(f"{where}: not a valid safetensors file ({exc})") from None


Fetch = Callable[[list[str]], dict[str, bytes]]  # file names -> verified bytes


def load_state(storage: LocalStorage, it: Iteration, kind: str, fetch: Fetch | None = None) -> dict[str, torch.Tensor]:
    """Assemble every full tensor of `kind` from the pieces in metadata.json.

    `fetch` supplies verified file bytes (default: read them here); the
    load_balanced fetcher gets them from other ranks instead.
    """
    fetch = fetch or (lambda names: read_verified(storage, it, names))
    tensors = it.metadata["tensors"].get(kind)
    if tensors is None:
        raise CheckpointError(f"{layout.join(it.path, layout.METADATA)}: holds no {kind!r} tensors")
    files = sorted({p["file"] for t in tensors.values() for p in t["pieces"]})
    parsed = {name: _parse_shard(data, layout.join(it.path, name)) for name, data in fetch(files).items()}
    out = {}
    for name, spec in tensors.items():
        dtype, shape = DTYPES[spec["dtype"]], spec["shape"]
        numel = 1
        for d in shape:
            numel *= d
        flat = torch.empty(numel, dtype=dtype)
        covered = 0
        for piece in sorted(spec["pieces"], key=lambda p: p["start"]):
            where = f"{layout.join(it.path, piece['file'])}[{name!r}]"
            part = parsed[piece["file"]].get(name)
            if part is None or part.dtype != dtype or part.numel() != piece["numel"] or piece["start"] != covered:
                raise CheckpointError(f"{where}: piece does not match metadata.json (dtype, size or position)")
            flat[covered : covered + part.numel()] = part.reshape(-1)
            covered += part.numel()
        if covered != numel:
            raise CheckpointError(f"{layout.join(it.path, layout.METADATA)}: tensor {name!r} pieces cover {covered} of {numel} elements")
        out[name] = flat.reshape(shape)
    return out


def load_rank_extras(storage: LocalStorage, it: Iteration, rank: int, fetch: Fetch | None = None) -> dict[str, str]:
    """This rank's RNG strings from its opt shard (same world size only)."""
    name = layout.shard_filename(it.metadata.get("prefix", "ckpt"), layout.OPTIM_KIND, rank, it.metadata["world_size"])
    data = (fetch or (lambda names: read_verified(storage, it, names)))([name])[name]
    header = shard_header(data, layout.join(it.path, name))
    extras = (header.get("__metadata__") or {}).get(RANK_EXTRAS_KEY)
    if not isinstance(extras, str):
        raise CheckpointError(f"{layout.join(it.path, name)}: header has no {RANK_EXTRAS_KEY!r} (the rank's RNG state)")
    return parse_json(extras.encode(), f"{layout.join(it.path, name)}: {RANK_EXTRAS_KEY}")


def iteration_steps(storage: LocalStorage, root: str) -> list[int]:
    """Steps of every `iteration_XXXXXXXX` directory under `root`, ascending."""
    steps = []
    for name in storage.listdir(root):
        step = layout.parse_iteration_dirname(name)
        if step is not None and storage.is_dir(layout.join(root, name)):
            steps.append(step)
    return sorted(steps)


EXPORT_FILE = "model.safetensors"
EXPORT_INDEX = "model.safetensors.index.json"


def is_export(storage: LocalStorage, path: str) -> bool:
    """A consolidated safetensors export (the layout the safetensors ecosystem uses)."""
    return any(storage.size(layout.join(path, name)) is not None for name in (EXPORT_FILE, EXPORT_INDEX))


def read_export(storage: LocalStorage, path: str) -> dict[str, torch.Tensor]:
    """Weights from `model.safetensors`, or from the shards a `model.safetensors.index.json` maps."""
    index_path = layout.join(path, EXPORT_INDEX)
    if storage.size(index_path) is not None:
        weight_map = parse_json(storage.read_bytes(index_path), index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: needs a non-empty 'weight_map' of tensor name -> file")
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, [EXPORT_FILE]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not isinstance(name, str) or not layout.is_plain_filename(name):
            raise CheckpointError(f"{index_path}: file name {name!r} points outside {path}; refusing to read it")
        file = layout.join(path, name)
        if storage.size(file) is None:
            raise CheckpointError(f"{file}: missing")
        out.update(_parse_shard(storage.read_bytes(file), file))
    if weight_map is not None and set(weight_map) != set(out):
        missing = sorted(set(weight_map) - set(out)) or sorted(set(out) - set(weight_map))
        raise CheckpointError(f"{index_path}: weight_map and the shard files disagree about tensor {missing[0]!r}")
    return out
