"""`common.json` and `metadata.json`: what they hold, how they are checked.

Both carry `format_version`; a reader refuses a version it does not know
rather than guess. Validation returns plain errors that name the file and
the key, because these files are exactly what a user edits by hand or a
broken disk garbles.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from . import paths
from .digest import CHECKSUMS, block_bounds
from .plan import DIM0, LAYOUTS, TensorSpec

CKPT_STATUS_OK = "ok"

# safetensors dtype tags <-> torch dtypes (the tags the safetensors format defines).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_TAGS = {v: k for k, v in DTYPES.items()}

# Keys a reader needs, with their JSON types.
COMMON_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format_version": int, "global_step": int, "global_batch_size": int, "step_num": int,
    "epoch_num": int, "loss_scale": (int, float), "ckpt_status": str, "consumed_samples": int,
    "world_size": int, "has_optimizer": bool, "job_id": str,
}
METADATA_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format_version": int, "iteration": int, "world_size": int, "block_size": int, "files": dict, "tensors": dict,
}
_HEX = re.compile(r"[0-9a-f]+")

# A safetensors header larger than this is not one we wrote (ours are ~100 bytes per tensor).
MAX_HEADER = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message says where and why."""


class DamagedShards(CheckpointError):
    """The bytes of a shard disagree with metadata.json (size, checksum, header): the loading
    ranks fall back to an older iteration, as the driver does for damaged metadata."""


def dumps(obj: dict) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def parse_json(data: bytes, where: str) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_fields(obj: dict, fields: dict[str, Any], where: str) -> None:
    for key, kind in fields.items():
        if key not in obj:
            raise CheckpointError(f"{where}: missing field {key!r}; the file is incomplete or not ours")
        value = obj[key]
        if isinstance(value, bool) and kind is not bool:
            raise CheckpointError(f"{where}: field {key!r} must be {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise CheckpointError(f"{where}: field {key!r} must be {_kind_name(kind)}, got {value!r}")
    version = obj["format_version"]
    if version != paths.FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {version} is not supported by this ray_resume "
            f"(it reads version {paths.FORMAT_VERSION}); use the ray_resume release that wrote it"
        )


def _kind_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true/false", dict: "an object"}[k] for k in kinds)


def validate_common(common: dict, where: str) -> None:
    check_fields(common, COMMON_FIELDS, where)
    if common["ckpt_status"] != CKPT_STATUS_OK:
        raise CheckpointError(f"{where}: ckpt_status is {common['ckpt_status']!r}, not {CKPT_STATUS_OK!r}; this iteration is not complete")
    for key in ("global_step", "global_batch_size", "consumed_samples", "world_size"):
        if common[key] < (1 if key in ("global_batch_size", "world_size") else 0):
            raise CheckpointError(f"{where}: field {key!r} has the impossible value {common[key]}")


def validate_metadata(meta: dict, where: str) -> None:
    """Structure checks: no file name can leave the iteration dir, every layout is known, every shard is listed."""
    check_fields(meta, METADATA_FIELDS, where)
    prefix, world = meta.get("prefix", "ckpt"), meta["world_size"]
    for key in ("world_size", "block_size"):
        if meta[key] < 1:
            raise CheckpointError(f"{where}: field {key!r} has the impossible value {meta[key]}")
    for name, info in meta["files"].items():
        if not paths.is_plain_filename(name):
            raise CheckpointError(f"{where}: file name {name!r} points outside the iteration directory; refusing to read it")
        _check_file_entry(info, meta["block_size"], f"{where}: files[{name!r}]")
    for kind, tensors in meta["tensors"].items():
        if kind not in (paths.MODEL_KIND, paths.OPTIM_KIND) or not isinstance(tensors, dict):
            raise CheckpointError(f"{where}: tensors[{kind!r}] is not a known kind (model, opt)")
        for name, t in tensors.items():
            label = f"{where}: tensors.{kind}[{name!r}]"
            if not isinstance(t, dict) or t.get("dtype") not in DTYPES or not isinstance(t.get("shape"), list):
                raise CheckpointError(f"{label} needs a known 'dtype' and a 'shape' list")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t["shape"]):
                raise CheckpointError(f"{label}: 'shape' must be a list of non-negative integers, got {t['shape']!r}")
            if t.get("layout") not in LAYOUTS or (t["layout"] == DIM0 and not t["shape"]):
                raise CheckpointError(f"{label}: 'layout' must be one of {list(LAYOUTS)} (dim0 needs a shape), got {t.get('layout')!r}")
        for rank in range(world):
            name = paths.shard_filename(prefix, kind, rank, world)
            if name not in meta["files"]:
                raise CheckpointError(f"{where}: shard {name!r} of rank {rank} is not listed in 'files'; the iteration is incomplete")


def validate_iteration(common: dict, meta: dict, step: int, directory: str) -> None:
    """A committed iteration agrees with itself: its directory's step, common.json and metadata.json.

    Each file may pass its own checks and still belong elsewhere (a copied or
    hand-edited common.json): a resume from it would redo or skip steps and
    then save over committed iterations, so any mismatch is damage.
    """
    common_file, meta_file = paths.join(directory, paths.COMMON), paths.join(directory, paths.METADATA)
    if common["global_step"] != step:
        raise CheckpointError(f"{common_file}: global_step {common['global_step']} is not this directory's iteration {step}")
    if meta["iteration"] != step:
        raise CheckpointError(f"{meta_file}: iteration {meta['iteration']} is not this directory's iteration {step}")
    world = meta["world_size"]
    if common["world_size"] != world:
        raise CheckpointError(f"{common_file}: world_size {common['world_size']}, but metadata.json lists the shards of {world} ranks")
    for name in meta["files"]:
        shard = paths.parse_shard_filename(name)
        if shard is None or shard["world"] != world or shard["rank"] >= world or shard["kind"] not in meta["tensors"]:
            raise CheckpointError(f"{meta_file}: files[{name!r}] is not a shard of this {world}-rank iteration")
    if common["has_optimizer"] != (paths.OPTIM_KIND in meta["tensors"]):
        lists = "lists" if paths.OPTIM_KIND in meta["tensors"] else "lists no"
        raise CheckpointError(f"{common_file}: has_optimizer is {str(common['has_optimizer']).lower()}, but metadata.json {lists} optimizer state")


def _check_file_entry(info: Any, block_size: int, label: str) -> None:
    sizes = [info.get(k) for k in ("size", "data_start")] if isinstance(info, dict) else [None]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes) or not 8 <= sizes[1] <= min(sizes[0], 8 + MAX_HEADER):
        raise CheckpointError(f"{label} needs integers 'size' and 'data_start' (8 <= data_start <= size, a header of at most {MAX_HEADER} bytes)")
    checksum = info.get("checksum")
    if not isinstance(checksum, str) or checksum not in CHECKSUMS:
        raise CheckpointError(f"{label}: checksum {checksum!r} is not one this ray_resume knows ({', '.join(CHECKSUMS)}); "
                              "use the ray_resume release that wrote it")
    expected, digits = len(block_bounds(info["size"], info["data_start"], block_size)), CHECKSUMS[checksum][1]
    digests = info.get("digests")
    if not isinstance(digests, list) or len(digests) != expected or not all(
            isinstance(d, str) and len(d) == digits and _HEX.fullmatch(d) for d in digests):
        raise CheckpointError(f"{label}: 'digests' must list {expected} lowercase hex {checksum} digests, one per checksum block")


def file_blocks(meta: dict, name: str) -> list[tuple[int, int, str]]:
    """(first byte, end byte, digest) of each checksum block of a listed (validated) file."""
    info = meta["files"][name]
    return [(lo, hi, d) for (lo, hi), d in zip(block_bounds(info["size"], info["data_start"], meta["block_size"]), info["digests"])]


def tensor_specs(meta: dict, kind: str) -> list[TensorSpec]:
    """The saved tensors of `kind` (validated metadata), as plan specs."""
    return [TensorSpec(name, t["dtype"], tuple(t["shape"]), DTYPES[t["dtype"]].itemsize, t["layout"])
            for name, t in meta["tensors"][kind].items()]


def build_metadata(iteration: int, prefix: str, manifests: list[dict]) -> dict:
    """metadata.json from every rank's manifest (ordered by rank): files and tensor layouts.

    Pieces are not listed: the layout of each tensor and `world_size` fix
    them (plan.SavePlan), so the file stays O(tensors + files) at any scale.
    """
    files = {}
    for manifest in manifests:
        for name, info in manifest["files"].items():
            files[name] = {**info, "rank": manifest["rank"]}
    tensors = {kind: {name: {"dtype": dtype, "shape": shape, "layout": how} for name, dtype, shape, how in specs}
               for kind, specs in manifests[0]["specs"].items()}
    return {
        "format_version": paths.FORMAT_VERSION,
        "iteration": iteration,
        "world_size": len(manifests),
        "block_size": manifests[0]["block_size"],
        "prefix": prefix,
        "files": files,
        "tensors": tensors,
    }
