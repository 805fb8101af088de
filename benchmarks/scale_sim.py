"""Scale simulation: the real planning and commit code at 1,024-16,384 ranks, with no training and no ranks.

    python -m benchmarks.scale_sim                      # 1,024 / 4,096 / 16,384 ranks (~5 min on 2 cores)
    python -m benchmarks.scale_sim --small              # CI: a tiny decoder at small world sizes, correctness only (seconds)
    python -m benchmarks.scale_sim --worlds 1024 --out /tmp/scale.json

The tensors are those of a 70B-class decoder (80 layers, hidden 8192, 64
heads / 8 KV heads, MLP 28672, vocab 128256, untied head): bf16 parameters in
the `model` shards; fp32 `exp_avg`, `exp_avg_sq`, `main_param` and a 0-d `step`
per parameter in the `opt` shards, named and ordered as `ray_resume.optim`
does. Two layouts: DDP (everything `split`) and FSDP2 (parameters and slots
`dim0`, `step` `split`).

For each saving world size W it

- times one rank's save plan (`plan.SavePlan` + `share(rank)`, file order,
  header) and every rank's, computed one after the other (FSDP: up to
  `--all-ranks-upto` ranks);
- synthesises every rank's manifest as `writer.write_shards` reports it
  (names from `paths.shard_filename`, sizes = the share's data bytes plus
  the safetensors header, a fake xxh3-128 digest per 4 MiB checksum block), creates
  the shard files as sparse files of those sizes in a local temp dir, and
  runs the driver's real commit (`commit.commit_iteration`: a stat per
  file, `validate_metadata`, metadata.json / config.yaml / common.json /
  tracker, each atomic with fsync) through a storage wrapper that counts
  the calls;
- times writing and parsing metadata.json, and measures the driver memory
  that holds the manifests;
- plans the load on W' = 3W/4 ranks with `load_balanced` off and on: one
  rank's plan is `SavePlan.overlaps` over `needed_range` for every tensor
  (and `fetch.balanced_owners` over the checksum blocks for
  `load_balanced`), timed; every rank's bytes and requests come from a
  vectorised form of the same plan that `--small` (and, on sampled ranks,
  the full run) checks equal to the per-rank plan.

The read policy simulated is the loader's (`fetch.StateLoader.load`, as
`Checkpointer._load` calls it): the files of saving rank s are read whole,
every checksum block checked, by loading rank s % W' (their verifier).
Under DDP every rank wants every tensor whole, and of every file it does
not verify it reads one byte range per piece (no header: metadata.json
places every piece); with `load_balanced` the checksum blocks of both
kinds' files are instead divided between the ranks
(`fetch.balanced_owners`: consecutive runs, or single blocks when a
rank's share is under 10 blocks), read and checked by their owner and
broadcast. Under FSDP a rank wants its dim-0 chunk of
each `dim0` tensor and the rest (the 0-d `step` tensors) whole: those are
pooled, i.e. only each file's verifier copies them out of the stream it
reads anyway and one all-reduce of the packed bytes (8-byte slot per
tensor) hands them to every rank, so of the files it does not verify a
rank reads only the ranges of the dim-0 pieces it needs (nothing is
pooled on a single loading rank). `load_balanced` applies to replicated
targets only, so under FSDP it changes nothing. Requests are counted as the reader makes storage calls
(`CHECKED_FILE_REQUESTS`; `tests/test_load_balanced.py` checks the counts
against the real loader).

`--small` asserts only correctness: every element of every tensor is
written by exactly one rank; every rank's load plan covers exactly the
elements that rank needs, from pieces its source files hold (both layouts,
load_balanced on and off, shrinking and growing), where a pooled tensor is
covered by the verifiers together plus the all-reduce: every rank packs
the same buffer, every pooled piece is copied by exactly one rank (the
verifier of its file) and the copies tile the tensor; the vectorised totals
equal the per-rank plans; metadata.json round-trips through the commit and
`validate_metadata`. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ray_resume.checkpoint import paths
from ray_resume.checkpoint.commit import commit_iteration
from ray_resume.checkpoint.digest import block_bounds
from ray_resume.checkpoint.loader import balanced_owners, divide_blocks
from ray_resume.checkpoint.reader import consecutive_runs
from ray_resume.checkpoint.plan import DIM0, SPLIT, SavePlan, TensorSpec, dim0_chunk, needed_range, split_replicated, split_specs
from ray_resume.checkpoint.schema import dumps, file_blocks, parse_json, tensor_specs, validate_metadata
from ray_resume.checkpoint.state import capture_rng
from ray_resume.checkpoint.storage import LocalStorage
from ray_resume.checkpoint.writer import CHECKSUM_BLOCK

PREFIX = "ckpt"
KINDS = (paths.MODEL_KIND, paths.OPTIM_KIND)
ITERATION = 1000


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Decoder:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """Parameter names and shapes in state-dict order (Llama naming, untied embedding and head)."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (self.mlp, h)), (p + "mlp.up_proj.weight", (self.mlp, h)),
                (p + "mlp.down_proj.weight", (h, self.mlp)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


LLAMA_70B = Decoder(layers=80, hidden=8192, heads=64, kv_heads=8, mlp=28672, vocab=128256)
# Small mode: row counts (48, 24, 136, 1000) that do not divide the world sizes below, so
# dim-0 chunks are uneven and trailing ranks hold nothing of some tensors.
TINY = Decoder(layers=2, hidden=48, heads=4, kv_heads=2, mlp=136, vocab=1000)


def state_specs(model: Decoder, fsdp: bool) -> dict[str, list[TensorSpec]]:
    """Every tensor of both kinds, in the order `ray_resume.optim` produces them."""
    how = DIM0 if fsdp else SPLIT
    params = model.params()
    opt = []
    for name, shape in params:  # state.optim_tensors: each param's slots, then the main params
        opt += [TensorSpec(f"{name}.exp_avg", "F32", shape, 4, how), TensorSpec(f"{name}.exp_avg_sq", "F32", shape, 4, how),
                TensorSpec(f"{name}.step", "F32", (), 4, SPLIT)]
    opt += [TensorSpec(f"{name}.main_param", "F32", shape, 4, how) for name, shape in params]
    return {paths.MODEL_KIND: [TensorSpec(n, "BF16", s, 2, how) for n, s in params], paths.OPTIM_KIND: opt}


# --------------------------------------------------------------------------- save side

# A safetensors header entry as writer.safetensors_header writes it:
# "NAME":{"dtype":"BF16","shape":[N],"data_offsets":[A,B]},  -> len(NAME) + ~50 bytes + digits.
# 80 is an upper estimate (digits of 10-11 places); the sim needs sizes close to, not equal to, the writer's.
HEADER_ENTRY = 80
# The opt shard's "__metadata__":{"rank_extras": ...}: this process's real RNG strings, JSON in JSON.
RANK_EXTRAS = len(json.dumps({"__metadata__": {"rank_extras": json.dumps(capture_rng(), sort_keys=True)}}))


def header_bytes(entry_bytes, kind: str):
    """8-byte length + the JSON header padded to 8, from the sum of entry estimates (int or numpy array)."""
    body = 2 + entry_bytes + (RANK_EXTRAS if kind == paths.OPTIM_KIND else 0)
    return 8 + (body + 7) // 8 * 8


def entry_bytes(name: str) -> int:
    return len(name.encode()) + HEADER_ENTRY


@dataclass
class RankShard:
    """One shard file of one rank as the writer lays it out."""

    name: str
    kind: str
    pieces: list  # plan.Piece, in safetensors file order
    data: int
    header: int

    @property
    def size(self) -> int:
        return self.header + self.data


_DTYPE_ORDER = {"BOOL": 0, "U8": 1, "I8": 2, "I16": 3, "F16": 4, "BF16": 5, "I32": 6, "F32": 7, "F64": 8, "I64": 9}


def rank_save_plan(specs: dict[str, list[TensorSpec]], world: int, rank: int, plans: dict[str, SavePlan] | None = None) -> list[RankShard]:
    """What one rank computes before it writes: the save plan, its share, the file order and header size."""
    out = []
    for kind in KINDS:
        plan = plans[kind] if plans else SavePlan(specs[kind], world)
        share = plan.share(rank)
        by_name = plan.specs
        order = sorted(share, key=lambda p: (-_DTYPE_ORDER[by_name[p.name].dtype], p.name.encode()))
        data = sum(p.numel * by_name[p.name].itemsize for p in order)
        hdr = header_bytes(sum(entry_bytes(p.name) for p in order), kind)
        out.append(RankShard(paths.shard_filename(PREFIX, kind, rank, world), kind, order, data, hdr))
    return out


def share_totals(specs: list[TensorSpec], world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, header entry bytes, piece count) of every rank's `SavePlan.share`, all ranks at once.

    Split pieces come from `plan.split_replicated` itself (O(tensors + W)
    pieces in all); dim-0 chunks from `plan.dim0_chunk`'s closed form on numpy
    arrays, one pass per distinct (rows, row bytes). `--small` checks this
    against `SavePlan.share(rank)` for every rank.
    """
    data = np.zeros(world, np.int64)
    entries = np.zeros(world, np.int64)
    pieces = np.zeros(world, np.int64)
    sizes = {s.name: s.itemsize for s in specs}
    for rank, share in enumerate(split_replicated(split_specs(specs), world)):
        for p in share:
            data[rank] += p.numel * sizes[p.name]
            entries[rank] += entry_bytes(p.name)
            pieces[rank] += 1
    groups: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])  # (rows, row bytes) -> [count, entry bytes]
    for s in specs:
        if s.layout == DIM0:
            g = groups[s.shape[0], s.row_numel * s.itemsize]
            g[0] += 1
            g[1] += entry_bytes(s.name)
    ranks = np.arange(world, dtype=np.int64)
    for (rows, row_bytes), (count, names) in groups.items():
        n = _chunk_rows(rows, world, ranks)
        held = (n > 0) & (row_bytes > 0)
        data += count * n * row_bytes
        entries += np.where(held, names, 0)
        pieces += np.where(held, count, 0)
    return data, entries, pieces


def _chunk_rows(rows: int, world: int, ranks: np.ndarray) -> np.ndarray:
    """Row count of each rank in torch.chunk(t, world, 0): plan.dim0_chunk on an array."""
    size = -(-rows // world)
    first = np.minimum(ranks * size, rows)
    return np.minimum(size, rows - first)


def shard_sizes(specs: dict[str, list[TensorSpec]], world: int) -> dict[str, dict[str, np.ndarray]]:
    """Per kind: data, header, size and piece count of every rank's shard file."""
    out = {}
    for kind in KINDS:
        data, entries, pieces = share_totals(specs[kind], world)
        header = header_bytes(entries, kind)
        out[kind] = {"data": data, "header": header, "size": data + header, "pieces": pieces}
    return out


def manifests_for(specs: dict[str, list[TensorSpec]], world: int, sizes, block_size: int = CHECKSUM_BLOCK) -> list[dict]:
    """Every rank's manifest, as `writer.write_shards` returns it (a fake xxh3-128 digest per checksum block; rank 0 carries the specs)."""
    out = []
    for rank in range(world):
        files = {}
        for kind in KINDS:
            name = paths.shard_filename(PREFIX, kind, rank, world)
            size, start = int(sizes[kind]["size"][rank]), int(sizes[kind]["header"][rank])
            digests = [xxhash.xxh3_128(f"{name}/{i}".encode()).hexdigest() for i in range(len(block_bounds(size, start, block_size)))]
            files[name] = {"size": size, "data_start": start, "checksum": "xxh3-128", "digests": digests, "kind": kind, "rank": rank}
        rows = {kind: [[s.name, s.dtype, list(s.shape), s.layout] for s in specs[kind]] for kind in KINDS} if rank == 0 else {}
        out.append({"rank": rank, "world_size": world, "block_size": block_size, "files": files, "specs": rows})
    return out


def make_sparse_files(iter_dir: str, manifests: list[dict]) -> None:
    """The shard files with their reported sizes and no data blocks (the commit only stats them)."""
    os.makedirs(iter_dir, exist_ok=True)
    for manifest in manifests:
        for name, info in manifest["files"].items():
            with open(os.path.join(iter_dir, name), "wb") as f:
                f.truncate(info["size"])


class CountingStorage:
    """LocalStorage with a count of every call the commit makes (each is one storage request)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*args, **kwargs):
            if name == "sizes":  # LocalStorage.sizes: one stat per name
                self.calls["size"] += len(args[1])
            else:
                self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


def common_json(world: int) -> dict:
    return {"global_step": ITERATION, "global_batch_size": 4 * world, "step_num": ITERATION, "epoch_num": 0,
            "consumed_samples": ITERATION * 4 * world, "loss_scale": 1.0}


SIM_CONFIG = {"checkpoint": {"prefix": PREFIX, "save_path": "<sim>", "save_max": 5}, "note": "scale simulation"}


# --------------------------------------------------------------------------- load side


# Storage calls of reader.ShardReader, checked against the real loader over gloo: a file a rank
# reads checksum blocks of (all of them when it verifies the file) costs a size check, then one
# streamed read per run of consecutive blocks; a ranged read needs no header (metadata.json places
# every piece) and costs one read per piece. Opening a file is not counted (on S3 pyarrow adds a
# HEAD per open).
CHECKED_FILE_REQUESTS = 1


@dataclass
class LoadPlan:
    """One loading rank's reads: checked files, ranged reads, what arrives by broadcast, and the pool.

    `checked` are the files it reads checksum blocks of: all of them for a
    file it verifies, its dealt blocks under load_balanced. `takes` are the
    element ranges it gets for itself (from files it reads or, under
    load_balanced, receives by broadcast). Tensors in `allreduced`
    (FSDP: the replicated leftovers, Adam's 0-d steps) it gets from the one
    all-reduce instead; `pooled` are the pieces of them it copies into that
    all-reduce, from the files it verifies.
    """

    rank: int
    checked: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    takes: list[tuple[str, str, int, int]] = field(default_factory=list)  # (file, tensor, lo, hi): every element range it gets
    ranged: dict[str, int] = field(default_factory=dict)  # file -> number of range reads (one per piece)
    pooled: list[tuple[str, str, int, int]] = field(default_factory=list)  # (file, tensor, lo, hi) it copies into the all-reduce
    allreduced: dict[str, int] = field(default_factory=dict)  # tensor -> its bytes in the packed buffer (8-byte aligned)
    bytes_read: int = 0
    requests: int = 0

    @property
    def files_touched(self) -> int:
        return len(self.checked) + len(self.ranged)

    @property
    def allreduce_bytes(self) -> int:
        return sum(self.allreduced.values())


def pool_bytes(spec: TensorSpec) -> int:
    """A pooled tensor's slot in `fetch.StateLoader._pool`'s packed buffer: its bytes rounded up to 8."""
    return -(-spec.nbytes // 8) * 8


def load_roles(specs: list[TensorSpec], new_world: int, *, fsdp: bool) -> tuple[bool, set[str]]:
    """(replicated, pooled) for one kind, as `Checkpointer._load` and `StateLoader.load` decide them.

    A tensor is sharded when the live one is an FSDP dim-0 shard of it (here:
    FSDP and the `dim0` layout); the rest are `shared` (every rank wants them
    whole). All shared (DDP) = replicated: direct or load_balanced. Otherwise
    the shared ones are pooled (verifiers copy them out, one all-reduce),
    unless there is a single loading rank.
    """
    shared = {s.name for s in specs if not (fsdp and s.layout == DIM0)}
    replicated = len(shared) == len(specs)
    return replicated, (set() if replicated or new_world == 1 else shared)


def load_plan(meta: dict, new_world: int, rank: int, *, fsdp: bool, balanced: bool,
              owners: dict[tuple[str, int], int] | None = None) -> LoadPlan:
    """Rank `rank` of `new_world` loading the iteration `meta` describes.

    Needs: each tensor's `needed_range` (its dim-0 chunk for a dim0 tensor under
    FSDP, else all of it); sources: `SavePlan.overlaps`. `owners`
    (load_balanced: (file, block) -> dealing rank) may be passed in when
    timing many ranks; each rank computes the same deal.
    """
    world, files, prefix = meta["world_size"], meta["files"], meta.get("prefix", "ckpt")
    plan = LoadPlan(rank)
    wanted: dict[str, list[tuple[str, int, int, int]]] = defaultdict(list)  # file -> (tensor, lo, hi, bytes), read by range
    for kind in meta["tensors"]:
        specs = tensor_specs(meta, kind)
        saved = SavePlan(specs, world)
        replicated, pooled = load_roles(specs, new_world, fsdp=fsdp)
        names = [paths.shard_filename(prefix, kind, r, world) for r in range(world)]
        verified = set()
        if balanced and replicated:  # one deal over both kinds' checksum blocks; each read by its owner, then broadcast
            owners = owners or lb_owners(meta, new_world)
            for name in names:
                blocks = file_blocks(meta, name)
                mine = [i for i in range(len(blocks)) if owners[name, i] == rank]
                if mine:
                    plan.checked.append(name)
                    plan.bytes_read += sum(blocks[i][1] - blocks[i][0] for i in mine)
                    plan.requests += CHECKED_FILE_REQUESTS + len(consecutive_runs(mine))
                if len(mine) < len(blocks):
                    plan.received.append(name)
        else:  # this rank verifies (reads whole) the files of saving ranks s with s % W' == rank
            verified = {n for n in names if files[n]["rank"] % new_world == rank}
            for name in sorted(verified):
                plan.checked.append(name)
                plan.bytes_read += files[name]["size"]
                plan.requests += CHECKED_FILE_REQUESTS + 1
        for spec in specs:
            start, numel = needed_range(spec, fsdp and spec.layout == DIM0, new_world, rank)
            if spec.name in pooled:
                plan.allreduced[spec.name] = pool_bytes(spec)
            for source, piece in saved.overlaps(spec.name, start, numel):
                lo, hi = max(start, piece.start), min(start + numel, piece.start + piece.numel)
                file = names[source]
                if spec.name in pooled:  # only the file's verifier copies it out of its stream; the all-reduce does the rest
                    if file in verified:
                        plan.pooled.append((file, spec.name, lo, hi))
                    continue
                plan.takes.append((file, spec.name, lo, hi))
                if file not in verified and not (balanced and replicated):
                    wanted[file].append((spec.name, lo, hi, (hi - lo) * spec.itemsize))
    plan.checked.sort()
    plan.received.sort()
    for file, reads in wanted.items():
        plan.ranged[file] = len(reads)
        plan.bytes_read += sum(r[3] for r in reads)
        plan.requests += len(reads)
    return plan


def lb_owners(meta: dict, new_world: int) -> dict[tuple[str, int], int]:
    """load_balanced: (file, checksum block) -> the rank that reads it, one deal over both kinds, as fetch.StateLoader does."""
    return balanced_owners(meta, KINDS, new_world)


def dealt_blocks(sizes, world: int, new_world: int, block_size: int) -> dict[str, np.ndarray]:
    """load_balanced in closed form: every checksum block in `fetch.balanced_owners`' order (kinds,
    then saving ranks, then blocks), with its kind, file, size and its rank (`fetch.divide_blocks`)."""
    kind, file, first, size = [], [], [], []
    for k, name in enumerate(KINDS):
        for r in range(world):
            blocks = block_bounds(int(sizes[name]["size"][r]), int(sizes[name]["header"][r]), block_size)
            kind += [k] * len(blocks)
            file += [k * world + r] * len(blocks)
            first += [i == 0 for i in range(len(blocks))]
            size += [hi - lo for lo, hi in blocks]
    owner = np.array(divide_blocks(size, new_world), np.int64)
    size = np.array(size, np.int64)
    run_starts = np.array(first) | np.r_[True, owner[1:] != owner[:-1]]  # a new file, or a new owner
    return {"kind": np.array(kind), "file": np.array(file, np.int64), "size": size, "owner": owner, "run_start": run_starts}


def read_totals(specs: dict[str, list[TensorSpec]], world: int, new_world: int, sizes, *, fsdp: bool, balanced: bool,
                block_size: int = CHECKSUM_BLOCK, block_cells: int = 1 << 25) -> dict[str, np.ndarray]:
    """bytes read, requests and files touched of every loading rank: `load_plan` for all ranks at once.

    The same policy as `load_plan`, in closed form over numpy arrays (one pass
    per distinct (rows, row bytes) of the dim-0 tensors, split pieces from
    `plan.split_replicated` (none read by range when pooled), the deal from
    `dealt_blocks`); `--small` checks it equal to `load_plan` for every rank.
    Memory: a bool matrix of `block_cells` (loading ranks x saved files) at a time.
    """
    out = {k: np.zeros(new_world, np.int64) for k in ("bytes", "requests", "files")}
    saved = np.arange(world, dtype=np.int64)
    ver = saved % new_world  # the loading rank that verifies (reads whole) each saved rank's files
    dealt = dealt_blocks(sizes, world, new_world, block_size) if balanced else None
    for k, kind in enumerate(KINDS):
        size, header = sizes[kind]["size"], sizes[kind]["header"]
        replicated, pooled = load_roles(specs[kind], new_world, fsdp=fsdp)
        if balanced and replicated:
            mine = dealt["kind"] == k
            owner = dealt["owner"][mine]
            pairs = np.unique(dealt["file"][mine] * new_world + owner)  # (file, rank) with blocks to read
            touched = np.bincount(pairs % new_world, minlength=new_world)
            out["bytes"] += np.bincount(owner, dealt["size"][mine].astype(np.float64), new_world).astype(np.int64)
            out["requests"] += CHECKED_FILE_REQUESTS * touched + np.bincount(owner[dealt["run_start"][mine]], minlength=new_world)
            out["files"] += touched
            continue
        # Verified files: saving rank s is read whole by loading rank s % W'.
        out["bytes"] += np.bincount(ver, size.astype(np.float64), new_world).astype(np.int64)
        out["requests"] += (CHECKED_FILE_REQUESTS + 1) * np.bincount(ver, minlength=new_world)
        out["files"] += np.bincount(ver, minlength=new_world)
        itemsize = {s.name: s.itemsize for s in specs[kind]}
        split_pieces = [(r, p.numel * itemsize[p.name]) for r, share in enumerate(split_replicated(split_specs(specs[kind]), world))
                        for p in share]
        if replicated:
            # Every rank needs every tensor whole: every piece of every file it does not verify.
            npieces = np.bincount(np.array([r for r, _ in split_pieces], np.int64), minlength=world)
            data = size - header
            ranged = npieces > 0  # the verifying rank reads these whole instead
            out["bytes"] += int(data[ranged].sum()) - np.bincount(ver[ranged], data[ranged].astype(np.float64), new_world).astype(np.int64)
            out["requests"] += int(npieces[ranged].sum()) - np.bincount(ver[ranged], npieces[ranged].astype(np.float64), new_world).astype(np.int64)
            out["files"] += int(ranged.sum()) - np.bincount(ver[ranged], minlength=new_world)
            continue
        groups: dict[tuple[int, int], int] = Counter((s.shape[0], s.row_numel * s.itemsize) for s in specs[kind] if s.layout == DIM0)
        rows_per_block = max(1, block_cells // world)
        for b0 in range(0, new_world, rows_per_block):
            ranks = np.arange(b0, min(new_world, b0 + rows_per_block), dtype=np.int64)
            touched = np.zeros((len(ranks), world), bool)
            spans = np.zeros(len(ranks), np.int64)
            got = np.zeros(len(ranks), np.int64)
            for (rows, row_bytes), count in groups.items():
                c = -(-rows // world)
                need = _chunk_rows(rows, new_world, ranks)
                a = np.minimum(ranks * -(-rows // new_world), rows)
                e = a + need
                has = (need > 0) & (row_bytes > 0)
                if not has.any():
                    continue
                first = np.where(has, a // c, 0)
                last = np.where(has, (e - 1) // c, -1)
                for j in range(int((last - first).max()) + 1):
                    s = first + j
                    take = has & (s <= last) & (ver[np.minimum(s, world - 1)] != ranks)
                    overlap = np.minimum(np.minimum(e, (s + 1) * c), rows) - np.maximum(a, s * c)
                    idx = np.nonzero(take)[0]
                    touched[idx, s[idx]] = True
                    spans += take * count
                    got += np.where(take, overlap, 0) * row_bytes * count
            for source, nbytes in ([] if pooled else split_pieces):  # pooled: only verifiers copy them (no extra reads)
                not_mine = ranks != ver[source]
                touched[not_mine, source] = True
                spans += not_mine
                got += not_mine * nbytes
            block = slice(b0, b0 + len(ranks))
            out["bytes"][block] += got
            out["requests"][block] += spans
            out["files"][block] += touched.sum(1)
    return out


# --------------------------------------------------------------------------- correctness checks


def check_save_coverage(specs: list[TensorSpec], world: int) -> None:
    """Every element of every tensor is in exactly one rank's `share` (pieces tile [0, numel))."""
    plan = SavePlan(specs, world)
    pieces = defaultdict(list)
    for rank in range(world):
        for p in plan.share(rank):
            assert p.numel > 0, f"empty piece {p} in rank {rank}'s share"
            pieces[p.name].append((p.start, p.start + p.numel))
    for s in specs:
        _assert_tiles(sorted(pieces.get(s.name, [])), 0, s.numel, f"save plan W={world}: {s.name}")


def _assert_tiles(intervals: list[tuple[int, int]], start: int, end: int, what: str) -> None:
    pos = start
    for lo, hi in intervals:
        assert lo == pos and hi > lo, f"{what}: element {pos} is {'covered twice' if lo < pos else 'missing'} ({lo}, {hi})"
        pos = hi
    assert pos == end, f"{what}: covers [{start}, {pos}) of [{start}, {end})"


def check_load_plan(meta: dict, plan: LoadPlan, new_world: int, *, fsdp: bool, balanced: bool) -> None:
    """The plan gets exactly the elements its rank needs, each from a piece its file really holds.

    Tensors it gets from the all-reduce are checked across all ranks by
    `check_pooled`; here: it gets nothing of them itself, and what it copies
    into the all-reduce comes from a file it verifies.
    """
    world = meta["world_size"]
    kinds = {paths.shard_filename(meta["prefix"], k, r, world): (k, r) for k in meta["tensors"] for r in range(world)}
    shares = {kind: SavePlan(tensor_specs(meta, kind), world) for kind in meta["tensors"]}

    def assert_held(file: str, name: str, lo: int, hi: int) -> None:
        kind, source = kinds[file]
        holds = [p for p in shares[kind].share(source) if p.name == name]
        assert len(holds) == 1 and holds[0].start <= lo < hi <= holds[0].start + holds[0].numel, \
            f"rank {plan.rank}: {file} holds no piece of {name} with elements [{lo}, {hi})"

    available = set(plan.checked) | set(plan.ranged) | set(plan.received)
    got = defaultdict(list)
    for file, name, lo, hi in plan.takes:
        assert file in available, f"rank {plan.rank}: takes {name} from {file}, which it neither reads nor receives"
        assert name not in plan.allreduced, f"rank {plan.rank}: reads {name} itself, which the all-reduce brings"
        assert_held(file, name, lo, hi)
        got[name].append((lo, hi))
    for file, name, lo, hi in plan.pooled:
        assert file in plan.checked and file not in plan.ranged, f"rank {plan.rank}: copies {name} out of {file}, which it does not verify"
        assert name in plan.allreduced
        assert_held(file, name, lo, hi)
    for kind in meta["tensors"]:
        specs = tensor_specs(meta, kind)
        _, pooled = load_roles(specs, new_world, fsdp=fsdp)
        assert pooled == {n for n in plan.allreduced if n in shares[kind].specs}, f"rank {plan.rank}: pools {sorted(plan.allreduced)}"
        for spec in specs:
            start, numel = needed_range(spec, fsdp and spec.layout == DIM0, new_world, plan.rank)
            if spec.name in pooled:
                assert (start, numel) == (0, spec.numel), f"{spec.name} is pooled but rank {plan.rank} needs only part of it"
                continue
            _assert_tiles(sorted(got.get(spec.name, [])), start, start + numel, f"load plan rank {plan.rank}/{new_world}: {spec.name}")
    if balanced and not fsdp:
        assert set(plan.checked) | set(plan.received) == set(meta["files"]) and not plan.ranged


def check_pooled(meta: dict, plans: list[LoadPlan], new_world: int, *, fsdp: bool) -> int:
    """The all-reduce gives every rank its pooled tensors whole: every rank packs the same tensors into the
    same buffer (8-byte slots), every pooled piece is copied by exactly one rank (its file's verifier), and
    those copies tile each tensor. Returns the packed bytes (0: no all-reduce)."""
    assert len(plans) == new_world
    layouts = {tuple(p.allreduced.items()) for p in plans}
    assert len(layouts) == 1, "ranks pack different all-reduce buffers"
    specs = {s.name: s for kind in meta["tensors"] for s in tensor_specs(meta, kind)}
    expected = {n: pool_bytes(specs[n]) for kind in meta["tensors"]
                for n in sorted(load_roles(tensor_specs(meta, kind), new_world, fsdp=fsdp)[1])}
    assert plans[0].allreduced == expected, "the all-reduce buffer is not the pooled tensors, 8-byte aligned"
    copies = Counter(c for p in plans for c in p.pooled)
    twice = [c for c, n in copies.items() if n > 1]
    assert not twice, f"pooled pieces copied by more than one rank: {twice[:3]}"
    world = meta["world_size"]
    for file, _, _, _ in copies:
        owner = meta["files"][file]["rank"] % new_world
        assert any(c[0] == file for c in plans[owner].pooled), f"{file}'s pooled pieces are not copied by its verifier {owner}"
    by_tensor = defaultdict(list)
    for file, name, lo, hi in copies:
        by_tensor[name].append((lo, hi))
    for name in expected:
        _assert_tiles(sorted(by_tensor.get(name, [])), 0, specs[name].numel, f"all-reduce over {new_world} ranks (from {world}): {name}")
    return sum(expected.values())


def check_vectorised_writes(specs: dict[str, list[TensorSpec]], world: int, sizes) -> None:
    """`share_totals` equals `SavePlan.share` (via `rank_save_plan`) for every rank."""
    plans = {kind: SavePlan(specs[kind], world) for kind in KINDS}
    for rank in range(world):
        for shard in rank_save_plan(specs, world, rank, plans):
            s = sizes[shard.kind]
            assert (shard.data, shard.header, len(shard.pieces)) == (s["data"][rank], s["header"][rank], s["pieces"][rank]), \
                f"vectorised write totals differ from SavePlan.share at rank {rank} of {world} ({shard.kind})"


# Small mode's checksum block: the tiny decoder's files hold 1 to ~500 blocks each, and
# load_balanced meets both of `fetch.divide_blocks`' cases (runs at few ranks, a deal at many).
SMALL_BLOCK = 4096


def check_small(tmp: str) -> dict:
    """Correctness only (CI): the save plan, every rank's load plan, the vectorised totals, the commit round trip."""
    started = time.perf_counter()
    cases = [(1, 3), (3, 1), (4, 3), (5, 7), (7, 5), (16, 12), (48, 36), (64, 48)]
    checked = Counter()
    for fsdp in (False, True):
        specs = state_specs(TINY, fsdp)
        for world, new_world in cases:
            for kind in KINDS:
                check_save_coverage(specs[kind], world)
                checked["save plans"] += 1
            sizes = shard_sizes(specs, world)
            check_vectorised_writes(specs, world, sizes)
            assert sum(int(sizes[k]["data"].sum()) for k in KINDS) == sum(s.nbytes for k in KINDS for s in specs[k])
            manifests = manifests_for(specs, world, sizes, SMALL_BLOCK)
            root = os.path.join(tmp, f"{'fsdp' if fsdp else 'ddp'}-{world}-{new_world}")
            make_sparse_files(paths.iteration_dir(root, ITERATION), manifests)
            storage = CountingStorage(LocalStorage())
            commit_iteration(storage, root, ITERATION, manifests, common_json(world), prefix=PREFIX, config=SIM_CONFIG, job_id="sim")
            assert storage.calls["size"] == 2 * world and storage.calls["write_atomic"] == 4
            path = paths.join(paths.iteration_dir(root, ITERATION), paths.METADATA)
            meta = parse_json(LocalStorage().read_bytes(path), path)
            validate_metadata(meta, path)
            for kind in KINDS:
                assert sorted(tensor_specs(meta, kind), key=str) == sorted(specs[kind], key=str), "metadata.json does not round-trip the tensor specs"
            assert {n: f["size"] for n, f in meta["files"].items()} == {n: f["size"] for m in manifests for n, f in m["files"].items()}
            assert LocalStorage().read_bytes(paths.tracker_path(root)) == f"{ITERATION}\n".encode()
            checked["commits"] += 1
            for balanced in (False, True):
                totals = read_totals(specs, world, new_world, sizes, fsdp=fsdp, balanced=balanced, block_size=SMALL_BLOCK, block_cells=world * 5)
                owners = lb_owners(meta, new_world) if balanced else None
                plans = []
                for rank in range(new_world):
                    plan = load_plan(meta, new_world, rank, fsdp=fsdp, balanced=balanced, owners=owners)
                    plans.append(plan)
                    check_load_plan(meta, plan, new_world, fsdp=fsdp, balanced=balanced)
                    assert (plan.bytes_read, plan.requests, plan.files_touched) == \
                        (totals["bytes"][rank], totals["requests"][rank], totals["files"][rank]), \
                        f"vectorised read totals differ from load_plan at rank {rank} ({world}->{new_world}, fsdp={fsdp}, balanced={balanced})"
                    checked["load plans"] += 1
                packed = check_pooled(meta, plans, new_world, fsdp=fsdp)
                assert (packed > 0) == (fsdp and new_world > 1), f"all-reduce of {packed} bytes ({world}->{new_world}, fsdp={fsdp})"
                if packed:
                    steps = [s for s in specs[paths.OPTIM_KIND] if s.name.endswith(".step")]
                    assert sorted(plans[0].allreduced) == sorted(s.name for s in steps) and packed == 8 * len(steps)
                    checked["all-reduces"] += 1
            shutil.rmtree(root)
    # A commit that finds a file of the wrong size refuses before writing anything.
    specs = state_specs(TINY, False)
    sizes = shard_sizes(specs, 4)
    manifests = manifests_for(specs, 4, sizes)
    root = os.path.join(tmp, "short")
    make_sparse_files(paths.iteration_dir(root, ITERATION), manifests)
    os.truncate(os.path.join(paths.iteration_dir(root, ITERATION), paths.shard_filename(PREFIX, "opt", 2, 4)), 10)
    try:
        commit_iteration(LocalStorage(), root, ITERATION, manifests, common_json(4), prefix=PREFIX, config=SIM_CONFIG, job_id="sim")
        raise AssertionError("a commit with a truncated shard went through")
    except RuntimeError as exc:
        assert "ckpt-opt-0000002-0000004.safetensors" in str(exc), exc
    assert not os.path.exists(paths.tracker_path(root)) and not os.path.exists(paths.join(paths.iteration_dir(root, ITERATION), paths.METADATA))
    return {"checked": dict(checked), "cases": cases, "seconds": round(time.perf_counter() - started, 2)}


# --------------------------------------------------------------------------- measurements


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


REPEATS = 3  # timings are the best of this many runs (the machine is shared; all runs go to the JSON)


def best(fn, *args, **kwargs):
    """(value, fastest seconds, every run's seconds) of REPEATS runs of fn(*args, **kwargs)."""
    runs = [timed(fn, *args, **kwargs) for _ in range(REPEATS)]
    times = [t for _, t in runs]
    return runs[0][0], min(times), [round(t, 4) for t in times]


MIB = 1 << 20
S3_PART = 10 * MIB  # pyarrow's S3 multipart part size (kPartUploadSize)


def s3_requests_per_save(sizes, world: int) -> dict:
    """Object-store requests of one save as the code makes them through pyarrow.fs (S3FileSystem defaults).

    pyarrow opens every output stream as a multipart upload (allow_delayed_open
    is off): CreateMultipartUpload + one UploadPart per 10 MiB (at least one) +
    CompleteMultipartUpload. The driver lists the iteration prefix (1,000 keys a
    page) and writes 4 small objects; rank 0 first checks for 2 stale JSON files.
    """
    shard = sum(int((2 + np.maximum(1, -(-sizes[k]["size"] // S3_PART))).sum()) for k in KINDS)
    files = 2 * world
    return {
        "shard_files": files,
        "shard_upload_requests": shard,
        "rank0_stale_json_checks": 2,
        "driver_list_pages": -(-(files + 3) // 1000),
        "driver_small_object_requests": 4 * 3,
        "driver_small_object_requests_with_allow_delayed_open": 4,
        "driver_head_requests_before": files,  # one HEAD per file, the commit's check before it listed
    }


def balance(values: np.ndarray) -> float:
    mean = float(values.mean())
    return round(float(values.max()) / mean, 4) if mean else 1.0


def hsdp_write_balance(specs: dict[str, list[TensorSpec]], world: int, group: int) -> float:
    """What-if (not implemented): HSDP with `group`-rank shard groups, each chunk split over its world/group replicas.

    Shard-group rank g holds `dim0_chunk(rows, group, g)` of each dim0 tensor;
    the world/group replicas of g cut that chunk's byte stream as the `split`
    layout cuts replicated state (`split_replicated`); `split` tensors stay
    split over all ranks. Returns max/mean of bytes written per rank.
    """
    replicas = world // group
    written = np.zeros(world, np.int64)
    for kind in KINDS:
        itemsize = {s.name: s.itemsize for s in specs[kind]}
        for rank, share in enumerate(split_replicated(split_specs(specs[kind]), world)):
            written[rank] += sum(p.numel * itemsize[p.name] for p in share)
        for g in range(group):
            local = []
            for s in specs[kind]:
                if s.layout == DIM0:
                    _, rows = dim0_chunk(s.shape[0], group, g)
                    local.append(TensorSpec(s.name, s.dtype, (rows,) + s.shape[1:], s.itemsize, SPLIT))
            for replica, share in enumerate(split_replicated(local, replicas)):
                by = {s.name: s.itemsize for s in local}
                written[replica * group + g] += sum(p.numel * by[p.name] for p in share)
    return balance(written)


def measure(world: int, fsdp: bool, tmp: str, *, sample_ranks: int, all_ranks: bool) -> dict:
    tag = "fsdp" if fsdp else "ddp"
    specs = state_specs(LLAMA_70B, fsdp)
    new_world = world * 3 // 4
    r: dict = {"world": world, "layout": tag, "load_world": new_world}
    log = lambda msg: print(f"  [{world} {tag}] {msg}", flush=True)  # noqa: E731

    # Save plan: one rank (what every rank computes), and every rank one after the other.
    probe = sorted({0, world // 2, world - 1})
    r["save_plan_rank_s"] = max(best(rank_save_plan, specs, world, rank)[1] for rank in probe)
    sizes, r["save_totals_vectorised_s"] = timed(shard_sizes, specs, world)
    if all_ranks:
        start = time.perf_counter()
        plans = {kind: SavePlan(specs[kind], world) for kind in KINDS}
        data = {kind: np.zeros(world, np.int64) for kind in KINDS}
        for rank in range(world):
            for shard in rank_save_plan(specs, world, rank, plans):
                data[shard.kind][rank] = shard.data
        r["save_plan_all_ranks_s"] = time.perf_counter() - start
        assert all((data[k] == sizes[k]["data"]).all() for k in KINDS), "vectorised write totals differ from SavePlan.share"
        r["vectorised_writes_checked_ranks"] = world
    else:
        plans = {kind: SavePlan(specs[kind], world) for kind in KINDS}
        for rank in random.Random(world).sample(range(world), min(world, sample_ranks)) + probe:
            for shard in rank_save_plan(specs, world, rank, plans):
                assert shard.data == sizes[shard.kind]["data"][rank] and shard.header == sizes[shard.kind]["header"][rank]
        r["vectorised_writes_checked_ranks"] = min(world, sample_ranks) + len(probe)
    written = sizes[paths.MODEL_KIND]["size"] + sizes[paths.OPTIM_KIND]["size"]
    r["checkpoint_bytes"] = int(written.sum())
    r["write_balance"] = balance(written)
    r["write_max_rank_bytes"] = int(written.max())
    r["write_mean_rank_bytes"] = float(written.mean())
    r["ranks_writing_no_data"] = int(((sizes["model"]["data"] + sizes["opt"]["data"]) == 0).sum())
    stream = split_replicated(split_specs(specs[paths.OPTIM_KIND]), world)
    r["split_stream_opt"] = {"bytes": sum(s.nbytes for s in split_specs(specs[paths.OPTIM_KIND])),
                             "files_holding_it": sum(1 for share in stream if share)}
    if fsdp:
        r["hsdp_write_balance"] = {str(g): hsdp_write_balance(specs, world, g) for g in (64, 1024) if world % g == 0 and g < world}
    log(f"save plan: rank {r['save_plan_rank_s']:.3f} s, all {r.get('save_plan_all_ranks_s', float('nan')):.1f} s, write balance {r['write_balance']}")

    # Manifests as the driver holds them, and their memory.
    tracemalloc.start()
    manifests = manifests_for(specs, world, sizes)
    r["driver_manifest_bytes"] = tracemalloc.get_traced_memory()[0]
    commons = [common_json(world) for _ in range(world)]  # what the actor held before: every rank's common too
    r["driver_manifest_bytes_with_every_common"] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del commons

    # The commit, on a real local directory of sparse shard files.
    root = os.path.join(tmp, f"{tag}-{world}")
    iter_dir = paths.iteration_dir(root, ITERATION)
    _, r["make_sparse_files_s"] = timed(make_sparse_files, iter_dir, manifests)
    storage = CountingStorage(LocalStorage())
    meta, r["commit_s"], r["commit_s_runs"] = best(commit_iteration, storage, root, ITERATION, manifests, common_json(world),
                                                   prefix=PREFIX, config=SIM_CONFIG, job_id="sim")
    r["commit_storage_calls"] = {k: v // REPEATS for k, v in storage.calls.items()}
    r["s3_requests_per_save"] = s3_requests_per_save(sizes, world)
    path = paths.join(iter_dir, paths.METADATA)
    blob, r["metadata_serialize_s"], _ = best(dumps, meta)  # schema.dumps, as the commit writes it
    _, r["metadata_serialize_compact_s"], _ = best(lambda m: json.dumps(m, sort_keys=True, separators=(",", ":")).encode(), meta)
    _, r["metadata_write_atomic_s"], _ = best(LocalStorage().write_atomic, path + ".sim", blob)
    os.unlink(path + ".sim")
    r["metadata_bytes"] = os.path.getsize(path)
    raw, r["metadata_read_s"], _ = best(LocalStorage().read_bytes, path)
    parsed, r["metadata_parse_s"], _ = best(parse_json, raw, path)
    _, r["metadata_validate_s"], _ = best(validate_metadata, parsed, path)
    assert parsed == meta
    log(f"commit {r['commit_s']:.2f} s ({r['commit_storage_calls']}), metadata {r['metadata_bytes'] / 1e6:.1f} MB "
        f"serialize {r['metadata_serialize_s']:.2f} s parse {r['metadata_parse_s']:.2f} s")
    shutil.rmtree(root)
    del manifests

    # Load on 3/4 of the ranks: one rank's plan timed, every rank's totals vectorised and sampled against it.
    load_probe = sorted({0, new_world // 2, new_world - 1})
    for key, balanced in (("direct", False), ("lb", True)):
        times = []
        for rank in load_probe:
            times.append(best(load_plan, meta, new_world, rank, fsdp=fsdp, balanced=balanced)[1])
        r[f"load_plan_rank_s_{key}"] = max(times)
        totals, r[f"load_totals_vectorised_s_{key}"] = timed(read_totals, specs, world, new_world, sizes, fsdp=fsdp, balanced=balanced)
        owners = lb_owners(meta, new_world) if balanced and not fsdp else None
        check = sorted(set(random.Random(new_world).sample(range(new_world), min(new_world, sample_ranks)) + load_probe))
        for rank in check:
            plan = load_plan(meta, new_world, rank, fsdp=fsdp, balanced=balanced, owners=owners)
            assert (plan.bytes_read, plan.requests, plan.files_touched) == \
                (totals["bytes"][rank], totals["requests"][rank], totals["files"][rank]), f"vectorised read totals differ at rank {rank}"
        r[f"vectorised_reads_checked_ranks_{key}"] = len(check)
        worst = int(np.argmax(totals["bytes"]))
        r[f"read_balance_{key}"] = balance(totals["bytes"])
        r[f"read_max_rank_{key}"] = {"rank": worst, "bytes": int(totals["bytes"][worst]), "requests": int(totals["requests"][worst]),
                                      "files": int(totals["files"][worst])}
        r[f"read_max_requests_{key}"] = int(totals["requests"].max())
        r[f"read_max_files_{key}"] = int(totals["files"].max())
        r[f"read_mean_rank_{key}"] = {k: round(float(totals[k].mean()), 1) for k in ("bytes", "requests", "files")}
        r[f"read_total_vs_checkpoint_{key}"] = round(float(totals["bytes"].sum()) / r["checkpoint_bytes"], 4)
        r[f"read_requests_total_{key}"] = int(totals["requests"].sum())
        log(f"load {key}: rank plan {r[f'load_plan_rank_s_{key}']:.3f} s, read balance {r[f'read_balance_{key}']}, "
            f"worst rank {r[f'read_max_rank_{key}']}")
    pool = load_plan(meta, new_world, 0, fsdp=fsdp, balanced=False).allreduced
    r["allreduce"] = {"tensors": len(pool), "bytes_per_rank": sum(pool.values()), "calls": int(bool(pool))}
    need = needed_bytes(specs, new_world, fsdp)
    r["read_need_balance"] = balance(need)  # what each rank must end up holding: no read policy does better
    r["read_need_max_rank_bytes"] = int(need.max())
    return r


# --------------------------------------------------------------------------- report


def needed_bytes(specs: dict[str, list[TensorSpec]], new_world: int, fsdp: bool) -> np.ndarray:
    """Bytes each loading rank needs (its dim-0 chunks under FSDP, everything else whole)."""
    ranks = np.arange(new_world, dtype=np.int64)
    need = np.zeros(new_world, np.int64)
    for kind in KINDS:
        for s in specs[kind]:
            if fsdp and s.layout == DIM0:
                need += _chunk_rows(s.shape[0], new_world, ranks) * (s.row_numel * s.itemsize)
            else:
                need += s.nbytes
    return need


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def table(results: dict) -> str:
    worlds = sorted(results["worlds"], key=int)
    cell = lambda w, tag: results["worlds"][w][tag]  # noqa: E731
    ddp = lambda w, key: cell(w, "ddp")[key]  # noqa: E731
    fsdp = lambda w, key: cell(w, "fsdp")[key]  # noqa: E731

    def row(label: str, fn) -> str:
        return f"| {label} | " + " | ".join(fn(w) for w in worlds) + " |"

    def seconds(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        "| saving ranks → loading ranks | " + " | ".join(f"{int(w):,} → {ddp(w, 'load_world'):,}" for w in worlds) + " |",
        "|---|" + "---|" * len(worlds),
        row("save plan, one rank, s (DDP / FSDP)", lambda w: f"{ddp(w, 'save_plan_rank_s'):.4f} / {fsdp(w, 'save_plan_rank_s'):.4f}"),
        row("save plan, every rank one after the other, s (DDP / FSDP)",
            lambda w: f"{seconds(cell(w, 'ddp').get('save_plan_all_ranks_s'))} / {seconds(cell(w, 'fsdp').get('save_plan_all_ranks_s'))}"),
        row("load plan, one rank, s: DDP direct / DDP load_balanced / FSDP",
            lambda w: f"{ddp(w, 'load_plan_rank_s_direct'):.3f} / {ddp(w, 'load_plan_rank_s_lb'):.3f} / {fsdp(w, 'load_plan_rank_s_direct'):.3f}"),
        row("metadata.json size", lambda w: fmt_bytes(ddp(w, "metadata_bytes"))),
        row("metadata.json serialize + atomic write, s", lambda w: f"{ddp(w, 'metadata_serialize_s') + ddp(w, 'metadata_write_atomic_s'):.3f}"),
        row("(what-if: serialize without indentation, s)", lambda w: f"{ddp(w, 'metadata_serialize_compact_s'):.3f}"),
        row("metadata.json read + parse + validate, s",
            lambda w: f"{ddp(w, 'metadata_read_s') + ddp(w, 'metadata_parse_s') + ddp(w, 'metadata_validate_s'):.3f}"),
        row("driver commit, s (DDP / FSDP)", lambda w: f"{ddp(w, 'commit_s'):.2f} / {fsdp(w, 'commit_s'):.2f}"),
        row("driver storage calls per commit", lambda w: f"{ddp(w, 'commit_storage_calls').get('size', 0):,} stat + "
                                                         f"{ddp(w, 'commit_storage_calls').get('write_atomic', 0)} atomic writes"),
        row("driver memory for the manifests (before: with every rank's common)",
            lambda w: f"{fmt_bytes(ddp(w, 'driver_manifest_bytes'))} ({fmt_bytes(ddp(w, 'driver_manifest_bytes_with_every_common'))})"),
        row("write balance max/mean: DDP / FSDP2", lambda w: f"{ddp(w, 'write_balance'):.3f} / {fsdp(w, 'write_balance'):.3f}"),
        row("FSDP2 ranks that write no tensor data", lambda w: f"{fsdp(w, 'ranks_writing_no_data'):,}"),
        row("what-if HSDP write balance, by shard group size",
            lambda w: ", ".join(f"{g}: {v:.3f}" for g, v in cell(w, "fsdp").get("hsdp_write_balance", {}).items()) or "-"),
        row("read balance max/mean: DDP direct / DDP load_balanced / FSDP2",
            lambda w: f"{ddp(w, 'read_balance_direct'):.3f} / {ddp(w, 'read_balance_lb'):.3f} / {fsdp(w, 'read_balance_direct'):.3f}"),
        row("FSDP2: balance of the bytes each rank needs (the floor for any read policy)",
            lambda w: f"{fsdp(w, 'read_need_balance'):.3f}"),
        row("largest rank read, DDP direct", lambda w: _worst(ddp(w, "read_max_rank_direct"))),
        row("largest rank read, DDP load_balanced", lambda w: _worst(ddp(w, "read_max_rank_lb"))),
        row("largest rank read, FSDP2", lambda w: _worst(fsdp(w, "read_max_rank_direct"))),
        row("FSDP2 per rank, max / mean: requests; files",
            lambda w: f"{fsdp(w, 'read_max_requests_direct'):,} / {fsdp(w, 'read_mean_rank_direct')['requests']:,.0f}; "
                      f"{fsdp(w, 'read_max_files_direct'):,} / {fsdp(w, 'read_mean_rank_direct')['files']:,.1f}"),
        row("FSDP2 all-reduce per load (the pooled 0-d `step` tensors)",
            lambda w: f"{fsdp(w, 'allreduce')['calls']} × {fmt_bytes(fsdp(w, 'allreduce')['bytes_per_rank'])} "
                      f"({fsdp(w, 'allreduce')['tensors']} tensors)"),
        row("storage requests per load, all ranks: DDP load_balanced / FSDP2",
            lambda w: f"{ddp(w, 'read_requests_total_lb'):,} / {fsdp(w, 'read_requests_total_direct'):,}"),
        row("bytes read by all ranks / checkpoint: DDP direct / load_balanced / FSDP2",
            lambda w: f"{ddp(w, 'read_total_vs_checkpoint_direct'):,.0f} / {ddp(w, 'read_total_vs_checkpoint_lb'):.2f} / "
                      f"{fsdp(w, 'read_total_vs_checkpoint_direct'):.2f}"),
    ]
    return "\n".join(lines)


def _worst(w: dict) -> str:
    return f"{fmt_bytes(w['bytes'])}, {w['requests']:,} req, {w['files']:,} files"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny decoder, small worlds, correctness only (CI, seconds)")
    ap.add_argument("--worlds", default="1024,4096,16384", help="comma list of saving world sizes (full mode)")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/scale_results.json; none with --small)")
    ap.add_argument("--dir", default=None, help="where the sparse shard files go (default: a temp dir)")
    ap.add_argument("--sample-ranks", type=int, default=24, help="ranks whose plans are checked against the vectorised totals")
    ap.add_argument("--all-ranks-upto", type=int, default=4096,
                    help="under FSDP, compute every rank's save plan one by one (and check the vectorised totals on all) "
                         "up to this world size (DDP: always)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="scale-sim-", dir=args.dir)
    try:
        if args.small:
            result = check_small(tmp)
            print(f"scale_sim --small: all correctness checks passed {result['checked']} in {result['seconds']} s")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
            return 0
        specs = state_specs(LLAMA_70B, False)
        results = {
            "command": "python -m benchmarks.scale_sim " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                        "load_average_at_start": os.getloadavg()},
            "model": {"params": sum(s.numel for s in specs["model"]), "tensors": {k: len(v) for k, v in specs.items()},
                      "checkpoint_data_bytes": sum(s.nbytes for k in KINDS for s in specs[k])},
            "worlds": {},
        }
        for world in (int(w) for w in args.worlds.split(",")):
            results["worlds"][str(world)] = {}
            for fsdp in (False, True):
                results["worlds"][str(world)]["fsdp" if fsdp else "ddp"] = measure(
                    world, fsdp, tmp, sample_ranks=args.sample_ranks, all_ranks=world <= args.all_ranks_upto or not fsdp)
        results["machine"]["load_average_at_end"] = os.getloadavg()
        out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale_results.json")
        with open(out, "w") as f:
            json.dump(results, f, indent=1, default=float)
        print(table(results))
        print(f"\nwrote {out}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
