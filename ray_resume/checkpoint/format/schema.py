"""`common.json` and `metadata.json`: what they hold, how they are checked, and what an iteration is.

Format 5 is MindSpore Transformers' own (mindformers 2.1: `checkpoint/checkpoint.py`,
`metadata.py`), so that its `load_checkpoint` opens what we commit:

- `common.json` is exactly its `CommonInfo`: `epoch_num`, `step_num`, `global_step`,
  `loss_scale`, `global_batch_size`, `consumed_samples`, `ckpt_status` (0 normal, 1 abnormal).
  MindFormers builds `CommonInfo(**json)`, which takes no other key.
- `metadata.json` holds its `state_dict_metadata` (each tensor's dtype, global shape, chunks as
  `global_offset`/`local_shape`, and the `layout` of a tensor cut in equal parts) and
  `storage_data` (which file holds each chunk); and, under `ray_resume`, what is ours alone: the
  format version, every file's size and block digests, and what a resume checks (the job, the
  world size, the optimizer's class, the data's fingerprint).

`parse.parse_iteration` turns an iteration of any kind we read into an `Iteration`. Pure: the
caller reads the files. Errors name the file and the key: these are files people edit and disks
garble.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from . import names, paths
from ...errors import AbnormalIteration, CheckpointError
from .digest import CHECKSUMS, block_bounds
from .plan import Piece, TensorSpec, rows_piece

# MindFormers' CommonInfo, field by field, with the JSON types it holds (mindformers 2.1).
# null where the loop that saved did not say (a train_func of yours need not count epochs or samples).
_COUNT = (int, type(None))
COMMON_FIELDS: dict[str, type | tuple[type, ...]] = {
    "epoch_num": _COUNT,
    "step_num": _COUNT,
    "global_step": int,
    "loss_scale": (int, float),
    "global_batch_size": _COUNT,
    "consumed_samples": _COUNT,
    "ckpt_status": int,
}
CKPT_NORMAL, CKPT_ABNORMAL = 0, 1  # MindFormers' CkptHealthStatus
LAYOUT_ALIAS = "dp"  # the device-matrix axis name of a cut in equal dim-0 parts

# A safetensors header larger than this is not one we wrote (ours are ~100 bytes per tensor).
MAX_HEADER = 64 << 20
_HEX = re.compile(r"[0-9a-f]+")


def dumps(obj: dict) -> bytes:
    """JSON as we write it: keys in the order they were built (MindFormers reads a layout's values in
    its order: device_matrix, tensor_map, interleaved_parallel, alias_name, rank_list)."""
    return (json.dumps(obj, indent=1) + "\n").encode()


def parse_json(data: bytes, where: str) -> dict:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _kind_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {
            int: "an integer",
            float: "a number",
            str: "a string",
            bool: "true/false",
            dict: "an object",
            list: "a list",
            type(None): "null",
        }[k]
        for k in kinds
    )


def check_fields(obj: dict, fields: dict[str, Any], where: str) -> None:
    for key, kind in fields.items():
        if key not in obj:
            raise CheckpointError(f"{where}: missing field {key!r}; the file is incomplete or not a checkpoint's")
        value = obj[key]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise CheckpointError(f"{where}: field {key!r} must be {_kind_name(kind)}, got {value!r}")


# ----------------------------------------------------------------------------- what an iteration is


@dataclass(frozen=True)
class Entry:
    """A tensor piece in a shard file: bytes [offset, offset + nbytes) of its data section, as its
    safetensors header gives it."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class StoredFile:
    """A shard file: who wrote it, its size, where its data starts, the digest of each block (None
    where the writer kept none: MindFormers), and the pieces it holds."""

    name: str
    kind: str
    rank: int
    size: int
    data_start: int
    checksum: str | None
    digests: list[str] | None
    entries: dict[str, Entry] = field(default_factory=dict)

    def blocks(self, block_size: int) -> list[tuple[int, int, str]]:
        """(first byte, end byte, digest) of each checksum block (`digest.block_bounds`)."""
        return [(lo, hi, d) for (lo, hi), d in zip(block_bounds(self.size, self.data_start, block_size), self.digests)]


@dataclass(frozen=True)
class Stored:
    """A saved tensor and its pieces, (file, piece) sorted by start, tiling it."""

    spec: TensorSpec
    pieces: tuple[tuple[str, Piece], ...]


@dataclass
class Iteration:
    """A validated iteration of any origin, and what was read to make it (`raw`, for the ranks)."""

    root: str
    step: int
    path: str
    common: dict  # CommonInfo's fields
    ours: dict  # what ray_resume keeps besides (job_id, optimizer, data, ...); {} for MindFormers'
    origin: str  # "ray_resume" or "mindformers"
    world_size: int
    block_size: int
    files: dict[str, StoredFile]
    tensors: dict[str, dict[str, Stored]]  # kind -> name -> the saved tensor
    raw: dict  # {"common", "metadata", "headers"}: parse_iteration(raw, ...) gives this iteration again

    @property
    def has_optimizer(self) -> bool:
        return paths.OPTIM_KIND in self.tensors

    def specs(self, kind: str) -> dict[str, TensorSpec]:
        return {name: t.spec for name, t in self.tensors.get(kind, {}).items()}

    def shard_files(self, kind: str) -> list[str]:
        """The kind's shard files, in saving-rank order."""
        return sorted((f.name for f in self.files.values() if f.kind == kind), key=lambda n: self.files[n].rank)


def common_of(common: dict, where: str, *, exact: bool) -> dict:
    """CommonInfo's fields, checked; `exact`: no other key (MindFormers' loader would refuse one)."""
    check_fields(common, COMMON_FIELDS, where)
    if exact and set(common) != set(COMMON_FIELDS):
        extra = sorted(set(common) - set(COMMON_FIELDS))[0]
        raise CheckpointError(
            f"{where}: field {extra!r} is not one of MindFormers' CommonInfo, whose loader refuses it"
        )
    if common["ckpt_status"] != CKPT_NORMAL:
        why = "abnormal" if common["ckpt_status"] == CKPT_ABNORMAL else "unknown"
        raise AbnormalIteration(
            f"{where}: ckpt_status is {common['ckpt_status']} ({why}, not {CKPT_NORMAL}: normal); "
            "MindFormers passes such an iteration over, and so does ray_resume"
        )
    for key in ("global_step", "consumed_samples", "global_batch_size"):
        if common[key] is not None and common[key] < (1 if key == "global_batch_size" else 0):
            raise CheckpointError(f"{where}: field {key!r} has the impossible value {common[key]}")
    return {key: common[key] for key in COMMON_FIELDS}


def check_step(common: dict, step: int, where: str) -> None:
    if common["global_step"] != step:
        raise CheckpointError(f"{where}: global_step {common['global_step']} is not this directory's iteration {step}")


FILE_FIELDS = {"size": int, "data_start": int, "checksum": str, "digests": list}


def _check_file_entry(info: Any, block_size: int, label: str) -> None:
    if not isinstance(info, dict):
        raise CheckpointError(f"{label} must be an object")
    check_fields(info, {"size": int, "data_start": int}, label)
    if not 8 <= info["data_start"] <= min(info["size"], 8 + MAX_HEADER):
        raise CheckpointError(f"{label} needs 8 <= data_start <= size, a header of at most {MAX_HEADER} bytes")
    checksum = info.get("checksum")
    if not isinstance(checksum, str) or checksum not in CHECKSUMS:
        raise CheckpointError(
            f"{label}: checksum {checksum!r} is not one this ray_resume knows ({', '.join(CHECKSUMS)}); "
            "use the ray_resume release that wrote it"
        )
    expected, digits = len(block_bounds(info["size"], info["data_start"], block_size)), CHECKSUMS[checksum][1]
    digests = info.get("digests")
    if (
        not isinstance(digests, list)
        or len(digests) != expected
        or not all(isinstance(d, str) and len(d) == digits and _HEX.fullmatch(d) for d in digests)
    ):
        raise CheckpointError(
            f"{label}: 'digests' must list {expected} lowercase hex {checksum} digests, one per checksum block"
        )


def listed_files(files: dict, ours: dict, where: str, *, prefix: str | None) -> dict[str, StoredFile]:
    """The shard files metadata.json lists (with digests), each checked; every rank's of every kind present."""
    world, block = ours["world_size"], ours["block_size"]
    out = {}
    for name, info in files.items():
        if not paths.is_plain_filename(name):
            raise CheckpointError(
                f"{where}: file name {name!r} points outside the iteration directory; refusing to read it"
            )
        shard = paths.parse_shard_filename(name)
        if shard is None or shard["world"] != world or shard["rank"] >= world or (prefix and shard["prefix"] != prefix):
            raise CheckpointError(f"{where}: files[{name!r}] is not a shard of this {world}-rank iteration")
        _check_file_entry(info, block, f"{where}: files[{name!r}]")
        out[name] = StoredFile(
            name, shard["kind"], shard["rank"], info["size"], info["data_start"], info["checksum"], info["digests"]
        )
    for kind in {f.kind for f in out.values()}:
        for rank in range(world):
            name = paths.shard_filename(prefix or "ckpt", kind, rank, world)
            if name not in out:
                raise CheckpointError(
                    f"{where}: shard {name!r} of rank {rank} is not listed in 'files'; the iteration is incomplete"
                )
    return out


def place_entries(files: dict[str, StoredFile], tensors: dict[str, dict[str, Stored]], where: str, flat: bool) -> None:
    """Each file's entries where the writer put them: its pieces in the order safetensors writes a
    file (dtype, largest first, then name), back to back. `flat`: format 4 stored each piece 1-D."""
    held: dict[str, list[tuple[TensorSpec, Piece]]] = {name: [] for name in files}
    for stored in (t for by_name in tensors.values() for t in by_name.values()):
        for file, piece in stored.pieces:
            held[file].append((stored.spec, piece))
    for name, pieces in held.items():
        offset = 0
        for spec, piece in sorted(pieces, key=lambda sp: (-SAFETENSORS_ORDER[sp[0].dtype], sp[1].name.encode())):
            nbytes = piece.numel * spec.itemsize
            files[name].entries[piece.name] = Entry(
                offset, nbytes, spec.dtype, (piece.numel,) if flat else local_shape(spec, piece)
            )
            offset += nbytes
        f = files[name]
        if f.data_start + offset != f.size:
            raise CheckpointError(
                f"{paths.join(where, name)}: metadata.json lists {f.size} bytes, but its header and the "
                f"tensors placed in it take {f.data_start + offset}; the metadata is inconsistent"
            )


# safetensors orders a file's tensors by dtype, largest first (the order of its Rust `Dtype` enum,
# descending), then by name; data offsets follow that order.
SAFETENSORS_ORDER = {"BOOL": 0, "U8": 1, "I8": 2, "I16": 3, "F16": 4, "BF16": 5, "I32": 6, "F32": 7, "F64": 8, "I64": 9}


def first_row(spec: TensorSpec, piece: Piece) -> int:
    """The first dim-0 row of a chunk of rows of `spec` (0 for a 0-d tensor, or rows of no element)."""
    return piece.start // spec.row_numel if spec.shape and spec.row_numel else 0


def local_shape(spec: TensorSpec, piece: Piece) -> tuple[int, ...]:
    """The shape of a chunk of rows of `spec`: its rows, then the tensor's other dimensions."""
    if not spec.shape:
        return ()
    rows = piece.numel // spec.row_numel if spec.row_numel else spec.rows
    return (rows, *spec.shape[1:])


def shard_id(name: str, offset: list[int]) -> str:
    """MindFormers' key of a chunk in storage_data (its utils.get_sharded_tensor_shard_id)."""
    return str(tuple((name, tuple(offset))))


def chunks_of(meta: dict, where: str, file_of) -> dict[str, dict[str, Stored]]:
    """The tensors of MindFormers' `state_dict_metadata`, each chunk placed by `storage_data` in the
    file `file_of(entries)` picks (None: none of them is here). Chunks must be ranges of dim-0 rows."""
    state, storage = meta.get("state_dict_metadata"), meta.get("storage_data")
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CheckpointError(
            f"{where}: needs the objects 'state_dict_metadata' and 'storage_data' (MindFormers' schema)"
        )
    tensors: dict[str, dict[str, Stored]] = {}
    for name, t in state.items():
        label = f"{where}: state_dict_metadata[{name!r}]"
        dtype = names.tag_of((t.get("properties") or {}).get("dtype")) if isinstance(t, dict) else None
        shape = t.get("global_shape") if isinstance(t, dict) else None
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CheckpointError(
                f"{label} needs a known properties.dtype and a 'global_shape' list of non-negative integers"
            )
        spec = TensorSpec(name, dtype, tuple(shape), names.itemsize(dtype))
        chunks = t.get("chunk")
        if not isinstance(chunks, list) or not chunks:
            raise CheckpointError(f"{label} needs a non-empty 'chunk' list")
        pieces, kind = [], None
        for c in chunks:
            offset, local = (c.get("global_offset"), c.get("local_shape")) if isinstance(c, dict) else (None, None)
            if not (
                isinstance(offset, list) and isinstance(local, list) and all(isinstance(n, int) for n in offset + local)
            ):
                raise CheckpointError(f"{label}: a chunk needs 'global_offset' and 'local_shape' lists of integers")
            key = shard_id(name, offset)
            if not shape and offset == [0] and local in ([], [1]):  # a scalar, keyed as MindFormers keys a whole tensor
                offset, local = [], []
            if len(offset) != len(shape) or len(local) != len(shape):
                raise CheckpointError(
                    f"{label}: chunk {offset} {local} does not have the tensor's {len(shape)} dimensions"
                )
            cut = [d for d in range(1, len(shape)) if offset[d] != 0 or local[d] != shape[d]]
            if cut:
                raise CheckpointError(
                    f"{label}: a chunk is cut along dimension {cut[0]} (tensor parallel), not in rows; "
                    "ray_resume reads tensors cut along dimension 0 only: merge it with MindFormers' "
                    "own conversion first"
                )
            entries = storage.get(key)
            if not isinstance(entries, list) or not entries:
                raise CheckpointError(f"{where}: storage_data has no file for chunk {key}")
            file = file_of(entries)
            if file is None:
                files = sorted({e.get("file_name") for e in entries if isinstance(e, dict)})
                raise CheckpointError(f"{where}: chunk {key} is in {files}, which this iteration does not hold")
            shard = paths.parse_shard_filename(file)
            if kind is not None and shard["kind"] != kind:
                raise CheckpointError(f"{label}: its chunks are in both model and opt files")
            kind = shard["kind"]
            first, rows = (offset[0], local[0]) if shape else (0, 1)
            pieces.append((file, rows_piece(spec, first, rows) if shape else Piece(name, 0, 1)))
        pieces.sort(key=lambda fp: fp[1].start)
        _check_tiles(spec, [p for _, p in pieces], label)
        tensors.setdefault(kind, {})[name] = Stored(spec, tuple(pieces))
    return tensors


def _check_tiles(spec: TensorSpec, pieces: list[Piece], label: str) -> None:
    """The pieces cover the tensor exactly once, in order."""
    at = 0
    for p in pieces:
        if p.start != at or p.numel < 0:
            raise CheckpointError(f"{label}: its chunks {'overlap' if p.start < at else 'leave a gap'} at element {at}")
        at += p.numel
    if at != spec.numel:
        raise CheckpointError(f"{label}: its chunks cover {at} of its {spec.numel} elements")


def readable_by_mindformers(it: Iteration, kind: str, name: str) -> bool:
    """Whether MindFormers' loader can place this tensor: whole in one file, or cut in equal dim-0 parts
    (its Layout cannot say torch.chunk's uneven ones, which FSDP2 makes when the rows do not divide)."""
    pieces = it.tensors[kind][name].pieces
    return len(pieces) == 1 or len({p.numel for _, p in pieces}) == 1
