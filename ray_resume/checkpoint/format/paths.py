"""Names and paths of a checkpoint root. Pure string logic: no I/O here.

A root looks like the spec's (MindSpore Transformers "resume training"):

    ROOT/latest_checkpointed_iteration.txt          tracker: newest committed step
    ROOT/iteration_00000200/metadata.json           where every tensor piece lives
    ROOT/iteration_00000200/common.json             resume facts (step, gbs, ...)
    ROOT/iteration_00000200/{prefix}-model-{rank:07d}-{world:07d}.safetensors
    ROOT/iteration_00000200/{prefix}-opt-{rank:07d}-{world:07d}.safetensors

Paths are plain strings joined with "/" so that object-store URIs survive
(pathlib collapses "s3://").
"""

from __future__ import annotations

import re

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
COMMON = "common.json"
CONFIG = "config.yaml"
MODEL_KIND = "model"
OPTIM_KIND = "opt"
# 2: tensors carry a layout (split | dim0); 3: a sha256 per checksum block, not per file;
# 4: each file names its checksum algorithm (xxh3-128 by default), its digests under "digests";
# 5: MindSpore Transformers' own schema: common.json is its CommonInfo, metadata.json its
#    state_dict_metadata and storage_data (chunks of dim-0 rows), ours under "ray_resume"
FORMAT_VERSION = 5

_ITERATION_RE = re.compile(r"^iteration_(\d{8})$")
# MindFormers names its shards the same way, the prefix optional (`model-0000000-0000001.safetensors`).
_SHARD_RE = re.compile(
    r"^(?:(?P<prefix>[A-Za-z0-9._-]+)-)?(?P<kind>model|opt)-(?P<rank>\d{7})-(?P<world>\d{7})\.safetensors$"
)


def on_object_storage(uri: str) -> bool:
    """Whether `uri` names object storage (s3://...) rather than a local or network file system (a plain
    path or file://...): the one place that decides it."""
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> str:
    """The file system path of a local `uri` (file:// taken off)."""
    return uri.removeprefix("file://")


def join(*parts: str) -> str:
    """Join path pieces with "/", keeping a URI scheme ("s3://b/x") intact."""
    head, *rest = parts
    out = head.rstrip("/") if head not in ("/", "") else head
    for part in rest:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if out and not out.endswith("/") else f"{out}{part}"
    return out


def iteration_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"iteration must be >= 0, got {step}")
    return f"iteration_{step:08d}"


def iteration_dir(root: str, step: int) -> str:
    return join(root, iteration_dirname(step))


def parse_iteration_dirname(name: str) -> int | None:
    """The step of an `iteration_XXXXXXXX` name, or None for anything else."""
    match = _ITERATION_RE.match(name)
    return int(match.group(1)) if match else None


def tracker_path(root: str) -> str:
    return join(root, TRACKER)


def shard_filename(prefix: str, kind: str, rank: int, world_size: int) -> str:
    if kind not in (MODEL_KIND, OPTIM_KIND):
        raise ValueError(f"shard kind must be {MODEL_KIND!r} or {OPTIM_KIND!r}, got {kind!r}")
    return f"{prefix}-{kind}-{rank:07d}-{world_size:07d}.safetensors"


def parse_shard_filename(name: str) -> dict | None:
    match = _SHARD_RE.match(name)
    if not match:
        return None
    return {"prefix": match["prefix"], "kind": match["kind"], "rank": int(match["rank"]), "world": int(match["world"])}


def is_plain_filename(name: str) -> bool:
    """True for a bare file name that cannot point outside its directory."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
