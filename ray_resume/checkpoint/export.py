"""A consolidated safetensors export, as `ray-resume export` writes it and Hugging Face's
`save_pretrained` does: found, its tensors' specs read from the headers, its weights read whole."""

from __future__ import annotations

import struct

import torch

from ..errors import CheckpointError
from . import paths
from .plan import TensorSpec
from .reader import parse_shard
from .schema import MAX_HEADER, parse_json
from .state import DTYPES
from .storage import Storage


EXPORT_FILE = "model.safetensors"
EXPORT_INDEX = "model.safetensors.index.json"


def is_export(storage: Storage, path: str) -> bool:
    """A consolidated safetensors export (the layout the safetensors ecosystem uses)."""
    return any(storage.size(paths.join(path, name)) is not None for name in (EXPORT_FILE, EXPORT_INDEX))


def export_files(storage: Storage, path: str) -> tuple[list[str], dict | None]:
    """The safetensors files of an export (paths), and its index's weight_map (None without an index)."""
    index_path = paths.join(path, EXPORT_INDEX)
    if storage.size(index_path) is None:
        names, weight_map = [EXPORT_FILE], None
    else:
        weight_map = parse_json(storage.read_bytes(index_path), index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: needs a non-empty 'weight_map' of tensor name -> file")
        names = sorted(set(weight_map.values()))
    files = []
    for name in names:
        if not isinstance(name, str) or not paths.is_plain_filename(name):
            raise CheckpointError(f"{index_path}: file name {name!r} points outside {path}; refusing to read it")
        file = paths.join(path, name)
        if storage.size(file) is None:
            raise CheckpointError(f"{file}: missing")
        files.append(file)
    return files, weight_map


def read_export(storage: Storage, path: str) -> tuple[dict[str, torch.Tensor], int]:
    """Weights from `model.safetensors`, or from the shards a `model.safetensors.index.json` maps; and the bytes read."""
    files, weight_map = export_files(storage, path)
    out: dict[str, torch.Tensor] = {}
    read = 0
    for file in files:
        data = storage.read_bytes(file)
        read += len(data)
        out.update(parse_shard(data, file))
    if weight_map is not None and set(weight_map) != set(out):
        missing = sorted(set(weight_map) - set(out)) or sorted(set(out) - set(weight_map))
        raise CheckpointError(
            f"{paths.join(path, EXPORT_INDEX)}: weight_map and the shard files disagree about tensor {missing[0]!r}"
        )
    return out, read


def export_specs(storage: Storage, path: str) -> dict[str, TensorSpec]:
    """Name, dtype and shape of every tensor of an export, from its safetensors headers alone."""
    specs = {}
    for file in export_files(storage, path)[0]:
        size = storage.size(file)
        if size < 8:
            raise CheckpointError(
                f"{file}: not a valid safetensors file ({size} bytes, no room for its header's length)"
            )
        (length,) = struct.unpack("<Q", storage.read_range(file, 0, 8))
        if not 8 + length <= size or length > MAX_HEADER:
            raise CheckpointError(f"{file}: not a valid safetensors file ({size} bytes, a header of {length})")
        header = parse_json(storage.read_range(file, 8, length), file)
        for name, t in header.items():
            if name == "__metadata__":
                continue
            shape = t.get("shape") if isinstance(t, dict) else None
            if not (isinstance(shape, list) and all(isinstance(n, int) for n in shape)):
                raise CheckpointError(f"{file}: not a valid safetensors file (tensor {name!r} has no integer shape)")
            dtype = DTYPES.get(t.get("dtype"))
            specs[name] = TensorSpec(name, t.get("dtype"), tuple(shape), dtype.itemsize if dtype else 0)
    return specs
