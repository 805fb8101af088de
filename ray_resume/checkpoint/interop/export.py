"""A consolidated safetensors export, as `ray-resume export` writes it and Hugging Face's
`save_pretrained` does: found, and its tensors' specs read from the headers (no torch here; its
weights are read whole by loader.read_export)."""

from __future__ import annotations

from ...errors import CheckpointError
from ..format import names, paths
from ..format.plan import TensorSpec
from ..io.iterations import read_header
from ..format.schema import parse_json
from ..io.storage import Storage


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


def export_specs(storage: Storage, path: str) -> dict[str, TensorSpec]:
    """Name, dtype and shape of every tensor of an export, from its safetensors headers alone."""
    specs = {}
    for file in export_files(storage, path)[0]:
        for name, t in read_header(storage, file)[1].items():
            if name == "__metadata__":
                continue
            shape = t.get("shape") if isinstance(t, dict) else None
            if not (isinstance(shape, list) and all(isinstance(n, int) for n in shape)):
                raise CheckpointError(f"{file}: not a valid safetensors file (tensor {name!r} has no integer shape)")
            tag = t.get("dtype")
            specs[name] = TensorSpec(name, tag, tuple(shape), names.itemsize(tag) if tag in names.DTYPES else 0)
    return specs
