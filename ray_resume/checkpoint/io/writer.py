"""Per-rank shard writing: this rank's share of the model and optimizer state.

Each rank computes the same save plan from the same tensor list and writes
only its own share, so no byte is written twice (replicated DDP state) and
every rank does about 1/W of the work (`plan.SavePlan`). The returned manifest is
what the driver needs to commit: file sizes and block digests, and which rows of
which tensors each file holds.

A shard file is a safetensors file that we stream ourselves: the header is
built here (byte for byte what `safetensors.torch.save` writes, which
`tests/test_async_save.py` checks) and the data section is written straight
from memory, with no serialized copy of it. The data comes from one of two
places, and the bytes on disk are the same either way:

- sync save: views of the live tensors (the training loop is blocked, so
  they cannot change while they are written: zero copies);
- async save: a snapshot in `SnapshotBuffers`, one flat buffer per kind laid
  out exactly as the file's data section, allocated once and reused, and placed
  at the file's alignment, so that the disk takes it from those very pages
  (`direct_io`: no copy into the page cache).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import direct_io
from ..format import paths
from ..format.digest import DEFAULT_CHECKSUM, BlockDigests, block_bounds, inline
from ..format.manifest import Manifest, WrittenFile
from ..format.plan import Piece, SavePlan, TensorSpec
from ..format.schema import SAFETENSORS_ORDER, local_shape
from ..format.state import DTYPE_TAGS, DTYPES, dim0_sharded, local_tensor
from .shard_file import ShardFile, write_file
from .storage import Storage

logger = logging.getLogger(__name__)

RANK_EXTRAS_KEY = "rank_extras"

# Bytes per checksum block of a shard's data section (digest.block_bounds): the
# unit a reader checks on its own and load_balanced divides between ranks. Each
# costs ~70 bytes of metadata.json (16 MB for a 1 TB checkpoint).
CHECKSUM_BLOCK = 4 << 20
# Bytes of a tensor copied into a snapshot buffer at a time, then hashed there: small enough to
# be in the CPU's cache still (L2), large enough that the loop costs little (benchmarks/README.md).
HASHED_PIECE = 256 << 10


def tensor_specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """Specs in the state's own (deterministic) key order; FSDP2 dim-0 shards are `sharded`."""
    return [
        TensorSpec(name, DTYPE_TAGS[t.dtype], tuple(t.shape), t.element_size(), dim0_sharded(t))
        for name, t in state.items()
    ]


def piece_data(t: torch.Tensor, spec: TensorSpec, piece: Piece) -> torch.Tensor:
    """The elements of `piece` as a flat view of this rank's tensor (its own chunk, for a dim-0 shard)."""
    if spec.sharded:
        flat = local_tensor(t).reshape(-1)
        if flat.numel() != piece.numel:
            raise RuntimeError(
                f"{spec.name}: local shard has {flat.numel()} elements, the dim-0 plan expects {piece.numel}"
            )
        return flat
    return local_tensor(t).detach().reshape(-1)[piece.start : piece.start + piece.numel]


@dataclass(frozen=True)
class Placed:
    """One tensor piece in a shard file: bytes [offset, offset + nbytes) of its data section."""

    piece: Piece
    spec: TensorSpec
    offset: int

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def nbytes(self) -> int:
        return self.piece.numel * self.spec.itemsize

    @property
    def rows(self) -> tuple[int, int]:
        """(first row, rows) of this chunk of its tensor (a 0-d tensor is one row)."""
        spec, piece = self.spec, self.piece
        if not spec.shape:
            return 0, 1
        if not spec.row_numel:  # no element in a row: the whole tensor, in one chunk
            return 0, spec.rows
        return piece.start // spec.row_numel, piece.numel // spec.row_numel


@dataclass(frozen=True)
class ShardLayout:
    """This rank's shard file of one kind: which pieces, in which file order, how many data bytes."""

    kind: str
    specs: tuple[TensorSpec, ...]  # every tensor of the kind (rank 0 reports them)
    entries: tuple[Placed, ...]  # the pieces in safetensors file order, with offsets
    nbytes: int  # size of the data section

    @property
    def key(self) -> tuple:
        """What a reusable snapshot buffer must match: names, dtypes and element ranges."""
        return tuple((e.piece.name, e.dtype, e.piece.start, e.piece.numel) for e in self.entries)


def shard_layouts(states: dict[str, dict[str, torch.Tensor] | None], rank: int, world_size: int) -> list[ShardLayout]:
    """The layout of every shard file this rank writes, model first, for the kinds present: one plan
    over every kind, so the ranks' bytes balance over the model and the optimizer together."""
    specs = {kind: tensor_specs(state) for kind, state in states.items() if state is not None}
    plan = SavePlan(specs, world_size)
    return [shard_layout(kind, plan, rank) for kind in specs]


def shard_layout(kind: str, plan: SavePlan, rank: int) -> ShardLayout:
    """Where `rank`'s pieces of `kind` sit in its file: safetensors order, offsets from the data section's start."""
    specs = plan.specs[kind]
    order = sorted(plan.share(kind, rank), key=lambda p: (-SAFETENSORS_ORDER[specs[p.name].dtype], p.name.encode()))
    entries, offset = [], 0
    for p in order:
        entries.append(Placed(p, specs[p.name], offset))
        offset += p.numel * specs[p.name].itemsize
    return ShardLayout(kind, tuple(specs.values()), tuple(entries), offset)


def safetensors_header(shard: ShardLayout, metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file, exactly as safetensors writes it."""
    if metadata is not None and len(metadata) > 1:
        # safetensors writes a metadata map in hash order: only one key is reproducible.
        raise ValueError("a shard header holds at most one metadata key (byte-reproducible files)")
    items = []
    if metadata is not None:
        items.append(
            _json("__metadata__") + ":{" + ",".join(f"{_json(k)}:{_json(v)}" for k, v in metadata.items()) + "}"
        )
    for e in shard.entries:
        shape = ",".join(map(str, local_shape(e.spec, e.piece)))
        items.append(
            f'{_json(e.piece.name)}:{{"dtype":"{e.dtype}","shape":[{shape}],'
            f'"data_offsets":[{e.offset},{e.offset + e.nbytes}]}}'
        )
    header = ("{" + ",".join(items) + "}").encode()
    header += b" " * (-len(header) % 8)  # safetensors pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(header)) + header


def _json(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, without a copy when it is a contiguous CPU tensor (GPU ones come to host)."""
    flat = t.detach().reshape(-1)
    flat = flat.cpu().contiguous() if flat.device.type != "cpu" else flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def live_data(shard: ShardLayout, state: dict[str, torch.Tensor]) -> list[memoryview]:
    """The data section as views of the live tensors, in file order (sync save: no copy)."""
    return [_bytes_of(piece_data(state[e.piece.name], e.spec, e.piece)) for e in shard.entries]


class SnapshotBuffers:
    """One flat byte buffer per shard kind, allocated once and reused by every async save.

    A buffer is keyed by its layout (tensor names, dtypes, element ranges);
    the same model and optimizer give the same layout every save, so after
    the first save nothing is allocated. A changed layout (say, optimizer
    state that appears later) gets a new buffer for that kind, logged.
    `shared`: the buffers are memfds a writer process maps (`writer_process`);
    otherwise plain (pinned, with a GPU) memory of this process.

    Each buffer has ALIGN bytes to spare, so that a save's data section can start where its memory
    is aligned as its place in the file is (after its header, whose length changes with the RNG
    state it holds): `direct_io` writes it from these pages with O_DIRECT.
    """

    def __init__(self, shared: bool = False):
        self._shared = shared
        self._buffers: dict[str, tuple[tuple, torch.Tensor]] = {}
        self._memfds: dict[str, tuple[int, mmap.mmap, int]] = {}  # kind -> (fd, its mapping, generation)
        self._placed: dict[str, tuple[int, int]] = {}  # kind -> the last save's data section in its buffer
        self.allocations = 0  # buffers allocated so far (tests, logs)

    def buffer(self, shard: ShardLayout) -> torch.Tensor:
        held = self._buffers.get(shard.kind)
        if held is not None and held[0] == shard.key:
            return held[1]
        if held is not None:
            logger.info(
                "snapshot buffer for %s shards: layout changed, reallocating %d bytes", shard.kind, shard.nbytes
            )
        self._release(shard.kind)  # free the old one before allocating the new one
        self.allocations += 1
        size = shard.nbytes + direct_io.ALIGN
        if self._shared:
            fd = os.memfd_create(f"ray_resume-snapshot-{shard.kind}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
            buf = torch.frombuffer(mapped, dtype=torch.uint8)
            self._memfds[shard.kind] = (fd, mapped, self.allocations)
        else:  # pinned host memory when there is a GPU: the snapshot copy is a fast DMA
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._buffers[shard.kind] = (shard.key, buf)
        return buf

    def shared(self, kind: str) -> tuple[int, int, int]:
        """The memfd of `kind`'s buffer, its size, and which allocation it is (a writer maps each once)."""
        fd, _, generation = self._memfds[kind]
        return fd, self._buffers[kind][1].numel(), generation

    def placed(self, kind: str) -> tuple[int, int]:
        """Where the last save's data section of `kind` starts in its buffer, and its bytes."""
        return self._placed[kind]

    def _release(self, kind: str) -> None:
        self._buffers.pop(kind, None)
        fd, _, _ = self._memfds.pop(kind, (None, None, None))
        if fd is not None:
            os.close(fd)  # the mappings (ours while a tensor views it, a writer's) keep the pages

    def take(
        self, shard: ShardLayout, state: dict[str, torch.Tensor], file: ShardFile, checksum: str | None
    ) -> tuple[ShardFile, list[memoryview]]:
        """Copy this rank's share of `state` into the kind's buffer, its data section aligned as it is in
        `file`; return `file` with the digests of its checksum blocks and the data section's view.

        With an inline `checksum` (xxh3-128) and every source in host memory, each piece is hashed as
        soon as it is copied, from the buffer's pages while they are still in the CPU's cache: a tenth
        of the copy's CPU, where a writer hashing the same bytes later reads them from memory again
        (half of it; benchmarks/README.md's save_cpu table). Otherwise (sha256, hashed on threads; a
        GPU's tensors, which come over whole and would be hashed from memory here, in the stall) or
        with no `checksum`: no digests, the writer hashes as it writes.
        """
        buf = self.buffer(shard)
        start = direct_io.aligned_start(buf.data_ptr(), len(file.head))
        self._placed[shard.kind] = (start, shard.nbytes)
        data = memoryview(buf.numpy())[start : start + shard.nbytes]
        sources = [piece_data(state[e.piece.name], e.spec, e.piece) for e in shard.entries]
        on_host = all(src.device.type == "cpu" for src in sources)
        digest = BlockDigests(checksum, 0, file.ends) if checksum and inline(checksum) and on_host else None
        if digest is not None:
            digest.update(file.head)
        with torch.no_grad():
            for e, src in zip(shard.entries, sources):
                dst = buf[start + e.offset : start + e.offset + e.nbytes].view(DTYPES[e.dtype])
                size = e.spec.itemsize
                step = max(1, src.numel() if digest is None else HASHED_PIECE // size)
                for i in range(0, src.numel(), step):
                    piece = dst[i : i + step]
                    piece.copy_(src[i : i + step])
                    if digest is not None:
                        digest.update(data[e.offset + i * size : e.offset + (i + piece.numel()) * size])
        if digest is not None:
            file = dataclasses.replace(file, digests=tuple(digest.hexdigests()))
        return file, [data]


def shard_files(
    root: str,
    step: int,
    shards: list[ShardLayout],
    *,
    prefix: str,
    rank: int,
    world_size: int,
    rank_extras: dict[str, str],
    block_size: int = CHECKSUM_BLOCK,
) -> list[ShardFile]:
    """What this rank writes for iteration `step`: each shard file's path, header and checksum blocks.

    `rank_extras` (RNG states, as strings) go into the opt shard's safetensors
    header: they belong to this rank and to the optimizer-resume path only. One
    header key: safetensors writes header maps in hash order, and a single
    entry keeps the file bytes reproducible (exact-resume tests compare bytes).
    """
    files = []
    for shard in shards:
        header = {RANK_EXTRAS_KEY: json.dumps(rank_extras, sort_keys=True)} if shard.kind == paths.OPTIM_KIND else None
        head = safetensors_header(shard, header)
        ends = [end for _, end in block_bounds(len(head) + shard.nbytes, len(head), block_size)]
        files.append(
            ShardFile(
                paths.join(paths.iteration_dir(root, step), paths.shard_filename(prefix, shard.kind, rank, world_size)),
                shard.kind,
                head,
                ends,
            )
        )
    return files


def write_shards(
    storage: Storage,
    root: str,
    step: int,
    *,
    prefix: str,
    rank: int,
    world_size: int,
    shards: list[tuple[ShardLayout, list[memoryview]]],
    rank_extras: dict[str, str],
    on_mid_write: Callable[[], None] | None = None,
    block_size: int = CHECKSUM_BLOCK,
    checksum: str = DEFAULT_CHECKSUM,
    writer=None,
    files: list[ShardFile] | None = None,
) -> Manifest:
    """Write this rank's shard files of iteration `step` from their data sections; return its manifest.

    Runs on the training thread (sync save) or the writer thread (async); with
    `writer` (a `writer_process.ProcessWriter` holding the data sections) the
    files are written by that process, and this thread only waits for it.
    `files`: `shard_files` of the same arguments, where the caller has them already (a rank's save
    makes them first: an async save places its snapshots by their headers' lengths).
    """
    iter_dir = paths.iteration_dir(root, step)
    storage.makedirs(iter_dir)
    if rank == 0:
        # A crash may have left this (uncommitted) iteration half written by an
        # earlier attempt. Its JSON must not describe the shards we write now.
        for name in (paths.METADATA, paths.COMMON):
            storage.remove(paths.join(iter_dir, name))
    files = files or shard_files(
        root,
        step,
        [s for s, _ in shards],
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        rank_extras=rank_extras,
        block_size=block_size,
    )
    if writer is None:
        written = [write_file(storage, f, data, checksum, on_mid_write) for f, (_, data) in zip(files, shards)]
    else:
        written = writer.write(files, checksum, on_mid_write)
    written_files, chunks, specs = {}, {}, {}
    for f, (shard, _), (size, digests) in zip(files, shards, written):
        written_files[f.name] = WrittenFile(size, len(f.head), checksum, digests)
        chunks[shard.kind] = [(e.piece.name, *e.rows) for e in sorted(shard.entries, key=lambda e: e.piece.name)]
        if rank == 0:
            specs[shard.kind] = [(s.name, s.dtype, list(s.shape)) for s in shard.specs]
    manifest = Manifest(rank, world_size, block_size, written_files, chunks, specs)
    logger.debug("rank %d wrote %s", rank, manifest.files)
    return manifest


def save_shards(
    storage: Storage,
    root: str,
    step: int,
    *,
    prefix: str,
    rank: int,
    world_size: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict[str, torch.Tensor] | None,
    rank_extras: dict[str, str],
    on_mid_write: Callable[[], None] | None = None,
    block_size: int = CHECKSUM_BLOCK,
    checksum: str = DEFAULT_CHECKSUM,
) -> Manifest:
    """Synchronous save: write this rank's shards straight from the live tensors; return its manifest."""
    states = {paths.MODEL_KIND: model_state, paths.OPTIM_KIND: optim_state}
    shards = [(s, live_data(s, states[s.kind])) for s in shard_layouts(states, rank, world_size)]
    return write_shards(
        storage,
        root,
        step,
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        shards=shards,
        rank_extras=rank_extras,
        on_mid_write=on_mid_write,
        block_size=block_size,
        checksum=checksum,
    )
