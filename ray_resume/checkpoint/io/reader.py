"""Verify and load a committed iteration's tensors (its metadata: iterations.py).

Order matters: the tracker names an iteration, its JSON is validated, every
file it lists is checked for size and the digest of each checksum block,
and only then is any tensor used. Nothing here writes, so a failed load
leaves storage as it was. Shards are parsed by safetensors (no pickle).

An iteration MindFormers wrote has no block digests: its files are checked
for size and by their safetensors headers (`schema.parse_iteration`), and
their bytes are read unchecked.
"""

from __future__ import annotations

import logging
import struct
from concurrent.futures import Future
from dataclasses import dataclass

import safetensors.torch
import torch

from ..format import paths
from ..format.digest import BlockDigests, hexdigest
from ..format.plan import Piece, TensorSpec, overlaps
from ..format.schema import Iteration, StoredFile, parse_json
from ...errors import CheckpointError
from ..format.state import DTYPES
from .storage import READ_BLOCK, Storage, retried
from .writer import RANK_EXTRAS_KEY

logger = logging.getLogger(__name__)


def read_verified(storage: Storage, it: Iteration, files: list[str]) -> dict[str, bytes]:
    """Whole files as bytes (tools and tests), each checked as a loader checks it: size, every block's digest, the header."""
    reader = ShardReader(storage, it)
    out = {}
    for name in files:
        reader.check_size(name)
        out[name] = storage.read_bytes(reader.path(name))
        for index, (lo, hi, _) in enumerate(reader.blocks(name)):
            reader.check_block(name, index, hexdigest(reader.checksum(name), out[name][lo:hi]))
        reader.check_header(name, out[name][: it.files[name].data_start])
    return out


@dataclass(frozen=True)
class Request:
    """Elements [lo, hi) of a saved piece, to be copied into `dest` (a flat view of the rank's tensor)."""

    piece: Piece
    spec: TensorSpec
    lo: int
    hi: int
    dest: torch.Tensor | None = None  # None: only listed (inspect)


class ShardReader:
    """Reads shard bytes of one iteration into destination tensors, counting the bytes read.

    Where each piece sits in its file is in the iteration (`StoredFile.entries`:
    from metadata.json alone for ours, so no read needs the file's header first).
    Two ways to read a file:

    - `read_checked` reads whole checksum blocks (all of the file unless
      told which), checks each one's digest, and for the header block that
      the header places every piece where the metadata says; requested bytes
      inside land straight in their tensors (no copy of the file is held).
      A file without digests (MindFormers') has its header checked and the
      requested bytes read.
    - `read_ranges` fetches only the requested byte ranges, unchecked: the
      rank that reads those blocks checks them, and all ranks agree that
      every check passed before any tensor is used (`loader.StateLoader`).
    """

    def __init__(self, storage: Storage, it: Iteration):
        self.storage, self.it = storage, it
        self.bytes_read = 0
        self._sized: set[str] = set()
        self._headers: dict[str, dict] = {}

    def path(self, file: str) -> str:
        return paths.join(self.it.path, file)

    def file(self, name: str) -> StoredFile:
        return self.it.files[name]

    def check_size(self, file: str) -> int:
        """The listed size, after checking it against storage (once per file)."""
        path, size = self.path(file), self.file(file).size
        if file in self._sized:
            return size
        self._sized.add(file)
        actual = self.storage.size(path)
        if actual is None:
            raise CheckpointError(f"{path}: shard listed in metadata.json is missing")
        if actual != size:
            raise CheckpointError(
                f"{path}: size is {actual} bytes, metadata.json says {size}; the shard is truncated or replaced"
            )
        return size

    def spans(self, file: str, requests: list[Request]) -> list[tuple[int, int, Request]]:
        """(first byte, end byte) in `file` of each request, with the request, sorted by position."""
        stored = self.file(file)
        out = []
        for r in requests:
            first = stored.data_start + stored.entries[r.piece.name].offset + (r.lo - r.piece.start) * r.spec.itemsize
            out.append((first, first + (r.hi - r.lo) * r.spec.itemsize, r))
        return sorted(out, key=lambda s: s[0])

    def header(self, file: str) -> dict:
        """The file's safetensors header, read as its first checksum block and checked (cached)."""
        if file not in self._headers:
            self.read_checked(file, [], blocks=[0])
        return self._headers[file]

    def check_header(self, file: str, head: bytes) -> dict:
        """The header (the file's bytes before `data_start`) must place every piece exactly where the metadata does."""
        path, stored = self.path(file), self.file(file)
        (length,) = struct.unpack("<Q", head[:8])
        if 8 + length != len(head):
            raise CheckpointError(
                f"{path}: safetensors header length {length} disagrees with data_start {len(head)} in metadata.json"
            )
        header = parse_json(head[8:], path)
        for name, e in stored.entries.items():
            if header.get(name) != {
                "dtype": e.dtype,
                "shape": list(e.shape),
                "data_offsets": [e.offset, e.offset + e.nbytes],
            }:
                raise CheckpointError(
                    f"{path}[{name!r}]: piece does not match metadata.json (dtype, shape or position)"
                )
        extra = sorted(set(header) - set(stored.entries) - {"__metadata__"})
        if extra:
            raise CheckpointError(
                f"{path}[{extra[0]!r}]: the header holds a tensor that metadata.json does not place in this file"
            )
        self._headers[file] = header
        return header

    def blocks(self, file: str) -> list[tuple[int, int, str]]:
        """(first byte, end byte, digest) of each checksum block of `file`; none where it has no digests."""
        stored = self.file(file)
        return stored.blocks(self.it.block_size) if stored.digests is not None else []

    def checksum(self, file: str) -> str:
        return self.file(file).checksum

    def check_block(self, file: str, index: int, digest: str) -> None:
        lo, hi, expected = self.blocks(file)[index]
        if digest != expected:
            raise CheckpointError(
                f"{self.path(file)}: {self.checksum(file)} does not match metadata.json (checksum block {index}, "
                f"bytes {lo}-{hi}); the shard is corrupt"
            )

    def read_checked(self, file: str, requests: list[Request], blocks: list[int] | None = None) -> None:
        """Read checksum blocks `blocks` (all by default), checking each; requested bytes in them land in their tensors.

        Consecutive blocks are read as one stream, in READ_BLOCK reads, so
        that hashing one read overlaps the next; only bytes no request wants
        pass through scratch buffers. A file without digests: its header is
        checked and the requested bytes read.
        """
        if self.file(file).digests is None:
            self._retried(file, lambda: self._read_headed(file, requests))
        else:
            self._retried(file, lambda: self._read_checked(file, requests, blocks))

    def _retried(self, file: str, read) -> None:
        """`read()` of `file`, read again from its start after a transient error (`retried`),
        `bytes_read` counting one pass."""
        before = self.bytes_read

        def attempt():
            self.bytes_read = before
            read()

        retried(attempt, f"read of {self.path(file)}")

    def _read_headed(self, file: str, requests: list[Request]) -> None:
        self.check_size(file)
        with self.storage.open_read(self.path(file)) as f:
            self.check_header(file, _read_exactly(f, self.file(file).data_start, self.path(file)))
            self.bytes_read += self.file(file).data_start
            for first, last, r in self.spans(file, requests):
                f.seek(first)
                _readinto_exactly(f, _writable_bytes(r.dest), self.path(file))
                self.bytes_read += last - first

    def _read_checked(self, file: str, requests: list[Request], blocks: list[int] | None) -> None:
        self.check_size(file)
        checksums = self.blocks(file)
        spans, scratch = self.spans(file, requests), _ScratchBlocks()
        with self.storage.open_read(self.path(file)) as f:
            for run in consecutive_runs(range(len(checksums)) if blocks is None else sorted(blocks)):
                lo, hi = checksums[run[0]][0], checksums[run[-1]][1]
                digest = BlockDigests(self.checksum(file), lo, [checksums[i][1] for i in run])
                head = self._stream(f, file, lo, hi, spans, digest, scratch)
                for index, found in zip(run, digest.hexdigests()):
                    self.check_block(file, index, found)
                if head is not None:
                    self.check_header(file, head)
                self.bytes_read += hi - lo

    def _stream(
        self, f, file: str, lo: int, hi: int, spans, digest: BlockDigests, scratch: _ScratchBlocks
    ) -> bytes | None:
        """Bytes [lo, hi) of `f` into the spans' tensors (scratch elsewhere), all hashed; the header bytes when lo is 0."""
        path = self.path(file)
        f.seek(lo)
        pos, head = lo, None
        if lo == 0:
            head = _read_exactly(f, self.file(file).data_start, path)
            digest.update(head)
            pos = len(head)
        for first, last, r in spans:
            if last <= pos or first >= hi:
                continue
            while pos < first:  # bytes no one asked for: hashed, not kept
                n = min(first - pos, READ_BLOCK)
                scratch.hashing(digest.update(_readinto_exactly(f, scratch.take(n), path)))
                pos += n
            dest = _writable_bytes(r.dest)  # file bytes [first, last)
            while pos < min(last, hi):
                n = min(min(last, hi) - pos, READ_BLOCK)
                digest.update(_readinto_exactly(f, dest[pos - first : pos - first + n], path))
                pos += n
        while pos < hi:
            n = min(hi - pos, READ_BLOCK)
            scratch.hashing(digest.update(_readinto_exactly(f, scratch.take(n), path)))
            pos += n
        return head

    def read_ranges(self, file: str, requests: list[Request]) -> None:
        """Fetch only the requested byte ranges, unchecked (see the class doc): no header, no size check."""

        def read():
            with self.storage.open_read(self.path(file)) as f:
                for first, last, r in self.spans(file, requests):
                    f.seek(first)
                    _readinto_exactly(f, _writable_bytes(r.dest), self.path(file))
                    self.bytes_read += last - first

        self._retried(file, read)


def consecutive_runs(indices) -> list[list[int]]:
    """Sorted indices grouped into runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class _ScratchBlocks:
    """Two scratch blocks used in turn: one is filled while the other's bytes are still being hashed."""

    def __init__(self):
        self._blocks: list[bytearray | None] = [None, None]
        self._hashed: list[list[Future]] = [[], []]
        self._turn = 0

    def take(self, n: int) -> memoryview:
        self._turn ^= 1
        for future in self._hashed[self._turn]:
            future.result()  # its bytes are hashed: safe to overwrite
        if self._blocks[self._turn] is None:
            self._blocks[self._turn] = bytearray(READ_BLOCK)
        return memoryview(self._blocks[self._turn])[:n]

    def hashing(self, futures: list[Future]) -> None:
        self._hashed[self._turn] = futures


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


def plan_reads(
    it: Iteration, kind: str, ranges: dict[str, tuple[int, int]], dests: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, list[Request]]]:
    """Destination tensors for the element `ranges` wanted of each tensor (new ones unless given
    in `dests`), and the reads (by file) that fill them."""
    if kind not in it.tensors:
        raise CheckpointError(f"{paths.join(it.path, paths.METADATA)}: holds no {kind!r} tensors")
    dests, reads = dict(dests or {}), {}
    for name, (start, numel) in ranges.items():
        stored = it.tensors[kind][name]
        spec = stored.spec
        dest = dests[name] if name in dests else dests.setdefault(name, torch.empty(numel, dtype=DTYPES[spec.dtype]))
        for file, piece in overlaps(list(stored.pieces), start, numel):
            lo, hi = max(start, piece.start), min(start + numel, piece.start + piece.numel)
            reads.setdefault(file, []).append(Request(piece, spec, lo, hi, dest[lo - start : hi - start]))
    return dests, reads


def saved_pieces(it: Iteration, kind: str) -> dict[str, list[Request]]:
    """Every saved piece of `kind`, by file, as whole-piece requests without a destination (verification)."""
    out: dict[str, list[Request]] = {file: [] for file in it.shard_files(kind)}
    for stored in it.tensors.get(kind, {}).values():
        for file, piece in stored.pieces:
            out[file].append(Request(piece, stored.spec, piece.start, piece.start + piece.numel))
    return out


def parse_shard(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own error type for lying headers
        raise CheckpointError(f"{where}: not a valid safetensors file ({exc})") from None


def load_rank_extras(reader: ShardReader, rank: int) -> dict[str, str]:
    """This rank's RNG strings from its opt shard's header (same world size only)."""
    name = reader.it.shard_files(paths.OPTIM_KIND)[rank]
    header = reader.header(name)
    extras = (header.get("__metadata__") or {}).get(RANK_EXTRAS_KEY)
    if not isinstance(extras, str):
        raise CheckpointError(f"{reader.path(name)}: header has no {RANK_EXTRAS_KEY!r} (the rank's RNG state)")
    return parse_json(extras.encode(), f"{reader.path(name)}: {RANK_EXTRAS_KEY}")
