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
from concurrent.futures import Future
from dataclasses import dataclass

import safetensors.torch
import torch

from . import layout
from .digest import OverlappedSha256
from .plan import Piece, SavePlan, TensorSpec
from .schema import DTYPES, CheckpointError, parse_json, tensor_specs, validate_common, validate_metadata
from .storage import READ_BLOCK, LocalStorage
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
    """Whole files as bytes (tools and tests), each checked as a loader checks it: size, then sha256."""
    reader = ShardReader(storage, it)
    out = {}
    for name in names:
        reader.check_size(name)
        out[name] = storage.read_bytes(reader.path(name))
        reader.check_sha256(name, hashlib.sha256(out[name]).hexdigest())
    return out


def check_no_extra_shards(storage: LocalStorage, it: Iteration) -> None:
    listed = set(it.metadata["files"])
    for name in storage.listdir(it.path):
        if layout.parse_shard_filename(name) and name not in listed:
            raise CheckpointError(f"{layout.join(it.path, name)}: shard file not listed in metadata.json; remove it or restore the matching metadata.json")


# A safetensors header larger than this is not one we wrote (ours are ~100 bytes per tensor).
MAX_HEADER = 64 << 20


@dataclass(frozen=True)
class Request:
    """Elements [lo, hi) of a saved piece, to be copied into `dest` (a flat view of the rank's tensor)."""

    piece: Piece
    spec: TensorSpec
    lo: int
    hi: int
    dest: torch.Tensor | None = None  # None: only checked (verification)


class ShardReader:
    """Reads shard bytes of one iteration into destination tensors, counting the bytes read.

    Two ways to read a file: `read_whole` reads all of it once, checking
    its sha256, with the requested pieces read straight into their tensors
    (no copy of the file is held); `read_ranges` fetches only the requested
    byte ranges (used when another rank verifies that file). Headers are
    read and checked against metadata.json before any piece is read.
    """

    def __init__(self, storage: LocalStorage, it: Iteration):
        self.storage, self.it = storage, it
        self.bytes_read = 0
        self._headers: dict[str, tuple[int, dict]] = {}
        self._sized: set[str] = set()

    def path(self, file: str) -> str:
        return layout.join(self.it.path, file)

    def _read_range(self, file: str, offset: int, length: int) -> bytes:
        self.bytes_read += length
        return self.storage.read_range(self.path(file), offset, length)

    def check_size(self, file: str) -> int:
        """The listed size, after checking it against storage (once per file)."""
        path, size = self.path(file), self.it.metadata["files"][file]["size"]
        if file in self._sized:
            return size
        self._sized.add(file)
        actual = self.storage.size(path)
        if actual is None:
            raise CheckpointError(f"{path}: shard listed in metadata.json is missing")
        if actual != size:
            raise CheckpointError(f"{path}: size is {actual} bytes, metadata.json says {size}; the shard is truncated or replaced")
        return size

    def header(self, file: str, head: bytes = b"") -> tuple[int, dict]:
        """(offset of the data section, header) of a listed shard file, after checking its size.

        `head` is the file's first bytes when a streamed read already has
        them; otherwise the header is fetched by two small range reads.
        """
        if file in self._headers:
            return self._headers[file]
        path, size = self.path(file), self.check_size(file)
        if size < 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head[:8] if len(head) >= 8 else self._read_range(file, 0, 8))
        if length > min(size - 8, MAX_HEADER):
            raise CheckpointError(f"{path}: safetensors header length {length} exceeds the file")
        text = head[8 : 8 + length] if len(head) >= 8 + length else self._read_range(file, 8, length)
        self._headers[file] = (8 + length, parse_json(text, path))
        return self._headers[file]

    def check(self, file: str, requests: list[Request]) -> list[tuple[int, int, Request]]:
        """(first byte, end byte, request) in the file for each request, sorted; the header must agree with metadata.json."""
        data_start, header = self.header(file)
        size = self.it.metadata["files"][file]["size"]
        spans = []
        for r in requests:
            entry = header.get(r.piece.name)
            nbytes = r.piece.numel * r.spec.itemsize
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                    or entry.get("dtype") != r.spec.dtype or entry.get("shape") != [r.piece.numel]
                    or offsets[1] - offsets[0] != nbytes or offsets[0] < 0 or data_start + offsets[1] > size):
                raise CheckpointError(f"{self.path(file)}[{r.piece.name!r}]: piece does not match metadata.json (dtype, size or position)")
            first = data_start + offsets[0] + (r.lo - r.piece.start) * r.spec.itemsize
            spans.append((first, first + (r.hi - r.lo) * r.spec.itemsize, r))
        return sorted(spans, key=lambda s: s[0])

    def read_whole(self, file: str, requests: list[Request]) -> None:
        """Read the whole file once, checking its sha256; requested pieces land straight in their tensors.

        Each requested span is read into its destination and hashed there;
        only the bytes between spans pass through scratch blocks. Reads go
        block by block so that hashing one block overlaps reading the next.
        """
        size, path = self.check_size(file), self.path(file)
        digest, scratch = OverlappedSha256(), _ScratchBlocks()
        with self.storage.open_read(path) as f:
            head = _read_exactly(f, min(size, READ_BLOCK), path)
            digest.update(head)
            spans = []
            if requests:  # a plain verification needs no header
                self.header(file, head)  # from the read itself: no extra request
                spans = [(first, last, _writable_bytes(r.dest)) for first, last, r in self.check(file, requests)]
            pos = len(head)
            for first, last, dest in spans + [(size, size, None)]:
                if first < pos:  # inside the head already read
                    dest[: min(last, pos) - first] = memoryview(head)[first : min(last, pos)]
                    first = min(last, pos)
                while pos < first:  # bytes no one asked for: hashed, not kept
                    n = min(first - pos, READ_BLOCK)
                    scratch.hashing(digest.update(_readinto_exactly(f, scratch.take(n), path)))
                    pos += n
                while pos < last:
                    start = pos - (last - len(dest))  # dest holds file bytes [last - len(dest), last)
                    n = min(last - pos, READ_BLOCK)
                    digest.update(_readinto_exactly(f, dest[start : start + n], path))
                    pos += n
        self.bytes_read += size
        self.check_sha256(file, digest.hexdigest())

    def check_sha256(self, file: str, hexdigest: str) -> None:
        if hexdigest != self.it.metadata["files"][file]["sha256"]:
            raise CheckpointError(f"{self.path(file)}: sha256 does not match metadata.json; the shard is corrupt")

    def read_ranges(self, file: str, requests: list[Request]) -> None:
        """Fetch only the requested byte ranges (the file's sha256 is checked by its verifying rank)."""
        with self.storage.open_read(self.path(file)) as f:
            for first, last, r in self.check(file, requests):
                f.seek(first)
                _readinto_exactly(f, _writable_bytes(r.dest), self.path(file))
                self.bytes_read += last - first


class _ScratchBlocks:
    """Two scratch blocks used in turn: one is filled while the other's bytes are still being hashed."""

    def __init__(self):
        self._blocks: list[bytearray | None] = [None, None]
        self._hashed: list[Future | None] = [None, None]
        self._turn = 0

    def take(self, n: int) -> memoryview:
        self._turn ^= 1
        if self._hashed[self._turn] is not None:
            self._hashed[self._turn].result()  # its last bytes are hashed: safe to overwrite
        if self._blocks[self._turn] is None:
            self._blocks[self._turn] = bytearray(READ_BLOCK)
        return memoryview(self._blocks[self._turn])[:n]

    def hashing(self, future: Future) -> None:
        self._hashed[self._turn] = future


def _read_exactly(f, n: int, path: str) -> bytes:
    buf = bytearray(n)
    _readinto_exactly(f, memoryview(buf), path)
    return bytes(buf)


def _readinto_exactly(f, view: memoryview, path: str) -> memoryview:
    """Fill `view` from `f` (a file may return short reads); return it. A file shorter than that is damaged."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{path}: ended early (read {done} of {len(view)} bytes); the shard is truncated")
        done += n
    return view


def _writable_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def plan_reads(it: Iteration, kind: str, ranges: dict[str, tuple[int, int]],
               dests: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[Request]]]:
    """Destination tensors for the element `ranges` wanted of each tensor (new ones unless given
    in `dests`), and the reads (by file) that fill them."""
    meta = it.metadata
    if kind not in meta["tensors"]:
        raise CheckpointError(f"{layout.join(it.path, layout.METADATA)}: holds no {kind!r} tensors")
    specs = {s.name: s for s in tensor_specs(meta, kind)}
    plan = SavePlan(list(specs.values()), meta["world_size"])
    files = shard_files(meta, kind)
    dests, reads = dict(dests or {}), {}
    for name, (start, numel) in ranges.items():
        spec = specs[name]
        dest = dests.setdefault(name, torch.empty(numel, dtype=DTYPES[spec.dtype]))
        for rank, piece in plan.overlaps(name, start, numel):
            lo, hi = max(start, piece.start), min(start + numel, piece.start + piece.numel)
            reads.setdefault(files[rank], []).append(Request(piece, spec, lo, hi, dest[lo - start : hi - start]))
    return dests, reads


def shard_files(metadata: dict, kind: str) -> list[str]:
    """The kind's shard files in saving-rank order."""
    return [layout.shard_filename(metadata.get("prefix", "ckpt"), kind, r, metadata["world_size"])
            for r in range(metadata["world_size"])]


def saved_pieces(it: Iteration, kind: str) -> dict[str, list[Request]]:
    """Every saved piece of `kind`, by file, as whole-piece requests without a destination (verification)."""
    specs = tensor_specs(it.metadata, kind)
    by_name = {s.name: s for s in specs}
    plan = SavePlan(specs, it.metadata["world_size"])
    return {file: [Request(p, by_name[p.name], p.start, p.start + p.numel) for p in plan.share(rank)]
            for rank, file in enumerate(shard_files(it.metadata, kind))}


def _parse_shard(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own error type for lying headers
        raise CheckpointError(f"{where}: not a valid safetensors file ({exc})") from None


def load_rank_extras(reader: ShardReader, rank: int) -> dict[str, str]:
    """This rank's RNG strings from its opt shard's header (same world size only)."""
    meta = reader.it.metadata
    name = layout.shard_filename(meta.get("prefix", "ckpt"), layout.OPTIM_KIND, rank, meta["world_size"])
    _, header = reader.header(name)
    extras = (header.get("__metadata__") or {}).get(RANK_EXTRAS_KEY)
    if not isinstance(extras, str):
        raise CheckpointError(f"{reader.path(name)}: header has no {RANK_EXTRAS_KEY!r} (the rank's RNG state)")
    return parse_json(extras.encode(), f"{reader.path(name)}: {RANK_EXTRAS_KEY}")


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
