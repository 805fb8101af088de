"""Scale simulation: the real planning, commit and load-planning code at 1,024-16,384 ranks, with no ranks.

    python -m benchmarks.scale_sim                  # DDP and FSDP2 at 1,024 / 4,096 / 16,384 saving ranks (~10 min)
    python -m benchmarks.scale_sim --small          # CI: a tiny decoder at small world sizes, correctness only (seconds)
    python -m benchmarks.scale_sim --worlds 1024 --out /tmp/scale.json

The tensors are those of a 70B-class decoder (80 layers, hidden 8192, 64 heads / 8 KV heads,
MLP 28672, vocab 128256, untied head): bf16 parameters in the `model` shards; fp32 Adam moments
(`adam_m.{p}`, `adam_v.{p}`), main parameters (`main_param.{p}`) and a 0-d `step.{p}` per
parameter in the `opt` shards, named as ray_resume writes them. Two layouts: DDP (everything
replicated) and FSDP2 (parameters and slots sharded on dim 0, the steps replicated).

For each saving world size W it

- builds the save plan (`plan.SavePlan`, what every rank builds) and one rank's share in file
  order, timed; every rank's bytes come from the plan (the sharded rows in torch.chunk's closed
  form), for the write balance;
- counts the chunks metadata.json lists: format 5 writes MindFormers' schema, which names every
  chunk of every tensor with the file that holds it, so its size grows with the chunks, not only
  the tensors. Where they are few enough to hold here (`--max-chunks`), it synthesises every
  rank's manifest as `writer.write_shards` reports it (sizes with an estimated header, a fake
  xxh3-128 digest per 4 MiB block, the rank's chunks), creates the shard files as sparse files,
  and runs the driver's real commit (`commit.commit_iteration`) through a storage wrapper that
  counts its calls; then times metadata.json's write, read and parse (`iterations.open_iteration`);
- plans the load on W' = 3W/4 ranks with load_balanced off and on, from that metadata.json: one
  rank's plan is `plan.overlaps` over `needed_range` of every tensor (and `loader.balanced_owners`
  over the checksum blocks for load_balanced), timed, and the bytes, requests and files of a
  sample of ranks (`--sample-ranks`, every rank in `--small`).

The read policy is the loader's (`loader.StateLoader.load`, as `restore._load` calls it): the
files of saving rank s are read whole, every checksum block checked, by loading rank s % W' (their
verifier); under DDP every rank wants every tensor whole and reads, of every file it does not
verify, one byte range per piece; with load_balanced the checksum blocks of both kinds' files are
divided between the ranks, read and checked by their owner and broadcast. Under FSDP a rank wants
its dim-0 chunk of each sharded tensor; the 0-d steps are pooled: each file's verifier copies them
out of the stream it reads anyway and one all-reduce hands them to every rank. Requests are
counted as the reader makes storage calls (`tests/test_load_balanced.py` checks the counts against
the real loader).

`--small` asserts correctness only: every element of every tensor written by exactly one rank, in
whole rows; the closed-form write totals equal every rank's share; metadata.json round-trips
through the real commit and reader; every rank's load plan gets exactly the elements it needs
from pieces its files hold (both layouts, load_balanced on and off, shrinking and growing), and
the pooled steps are copied once each by their file's verifier. No timing is asserted anywhere.
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

from ray_resume.checkpoint.format import names, paths
from ray_resume.checkpoint.commit import commit_iteration
from ray_resume.checkpoint.format.digest import block_bounds
from ray_resume.checkpoint.loader import balanced_owners
from ray_resume.checkpoint.format.manifest import Manifest, WrittenFile
from ray_resume.checkpoint.format.plan import SavePlan, TensorSpec, dim0_chunk, needed_range, overlaps
from ray_resume.checkpoint.io.reader import consecutive_runs
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.format.schema import SAFETENSORS_ORDER, Iteration, dumps
from ray_resume.checkpoint.format.state import capture_rng
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import CHECKSUM_BLOCK

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
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (self.mlp, h)),
                (p + "mlp.up_proj.weight", (self.mlp, h)),
                (p + "mlp.down_proj.weight", (h, self.mlp)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


LLAMA_70B = Decoder(layers=80, hidden=8192, heads=64, kv_heads=8, mlp=28672, vocab=128256)
# Small mode: row counts (48, 24, 136, 1000) that do not divide the world sizes below, so
# dim-0 chunks are uneven and trailing ranks hold nothing of some tensors.
TINY = Decoder(layers=2, hidden=48, heads=4, kv_heads=2, mlp=136, vocab=1000)


def state_specs(model: Decoder, fsdp: bool) -> dict[str, list[TensorSpec]]:
    """Every tensor of both kinds, named and ordered as `ray_resume.optim` produces them."""
    params = model.params()
    opt = []
    # state.optim_tensors: each param's slots (AdamW: step, then its moments), then the main params
    for name, shape in params:
        opt += [
            TensorSpec(names.state_name(name, "step"), "F32", (), 4),
            TensorSpec(names.state_name(name, "exp_avg"), "F32", shape, 4, fsdp),
            TensorSpec(names.state_name(name, "exp_avg_sq"), "F32", shape, 4, fsdp),
        ]
    opt += [TensorSpec(names.state_name(name, names.MAIN_PARAM), "F32", shape, 4, fsdp) for name, shape in params]
    return {paths.MODEL_KIND: [TensorSpec(n, "BF16", s, 2, fsdp) for n, s in params], paths.OPTIM_KIND: opt}


# --------------------------------------------------------------------------- save side

# A safetensors header entry as writer.safetensors_header writes it:
# "NAME":{"dtype":"BF16","shape":[R,C],"data_offsets":[A,B]},  -> len(NAME) + ~50 bytes + digits.
# 80 is an upper estimate; the sim needs sizes close to, not equal to, the writer's.
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


def rank_shards(plan: SavePlan, rank: int) -> list[RankShard]:
    """What one rank computes before it writes: its share of the plan, the file order and the header size."""
    out = []
    for kind in KINDS:
        specs = plan.specs[kind]
        order = sorted(plan.share(kind, rank), key=lambda p: (-SAFETENSORS_ORDER[specs[p.name].dtype], p.name.encode()))
        data = sum(p.numel * specs[p.name].itemsize for p in order)
        out.append(
            RankShard(
                paths.shard_filename(PREFIX, kind, rank, plan.world_size),
                kind,
                order,
                data,
                header_bytes(sum(entry_bytes(p.name) for p in order), kind),
            )
        )
    return out


def _chunk_rows(rows: int, world: int, ranks: np.ndarray) -> np.ndarray:
    """Row count of each rank in torch.chunk(t, world, 0): plan.dim0_chunk on an array."""
    size = -(-rows // world)
    first = np.minimum(ranks * size, rows)
    return np.minimum(size, rows - first)


def shard_sizes(plan: SavePlan) -> dict[str, dict[str, np.ndarray]]:
    """Per kind: data, header, size and piece count of every rank's shard file, all ranks at once: the
    replicated parts from the plan, the sharded rows in torch.chunk's closed form (one pass per
    distinct (rows, row bytes)). `--small` checks it against every rank's `rank_shards`."""
    world = plan.world_size
    ranks = np.arange(world, dtype=np.int64)
    out = {}
    for kind in KINDS:
        data, entries, pieces = (np.zeros(world, np.int64) for _ in range(3))
        # (rows, row bytes) -> [count, entry bytes]
        groups: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
        for name, spec in plan.specs[kind].items():
            placed = plan._placed[kind].get(name)
            if placed is None:
                g = groups[spec.rows, spec.row_numel * spec.itemsize]
                g[0] += 1
                g[1] += entry_bytes(name)
                continue
            for rank, piece in placed:
                data[rank] += piece.numel * spec.itemsize
                entries[rank] += entry_bytes(name)
                pieces[rank] += 1
        for (rows, row_bytes), (count, name_bytes) in groups.items():
            n = _chunk_rows(rows, world, ranks)
            held = n > 0
            data += count * n * row_bytes
            entries += np.where(held, name_bytes, 0)
            pieces += np.where(held, count, 0)
        header = header_bytes(entries, kind)
        out[kind] = {"data": data, "header": header, "size": data + header, "pieces": pieces}
    return out


def chunk_count(plan: SavePlan) -> int:
    """The chunks metadata.json lists: every replicated part, and a sharded tensor's rows on every rank that holds some."""
    count = 0
    for kind, specs in plan.specs.items():
        for name, spec in specs.items():
            placed = plan._placed[kind].get(name)
            count += len(placed) if placed is not None else max(1, -(-spec.rows // -(-spec.rows // plan.world_size)))
    return count


def manifests_for(plan: SavePlan, sizes, block_size: int = CHECKSUM_BLOCK) -> list[Manifest]:
    """Every rank's manifest, as `writer.write_shards` returns it (a fake xxh3-128 digest per checksum
    block, the rank's chunks; rank 0 carries the specs)."""
    world = plan.world_size
    held: list[dict[str, list]] = [{kind: [] for kind in KINDS} for _ in range(world)]
    for kind, specs in plan.specs.items():
        for name, spec in specs.items():
            if name in plan._placed[kind]:
                for rank, piece in plan._placed[kind][name]:
                    held[rank][kind].append(
                        (
                            name,
                            piece.start // spec.row_numel if spec.shape else 0,
                            piece.numel // spec.row_numel if spec.shape else 1,
                        )
                    )
            else:
                for rank in range(world):
                    first, rows = dim0_chunk(spec.rows, world, rank)
                    if rows or (rank == 0 and not spec.rows):
                        held[rank][kind].append((name, first, rows))
    out = []
    for rank in range(world):
        files = {}
        for kind in KINDS:
            name = paths.shard_filename(PREFIX, kind, rank, world)
            size, start = int(sizes[kind]["size"][rank]), int(sizes[kind]["header"][rank])
            digests = [
                xxhash.xxh3_128(f"{name}/{i}".encode()).hexdigest()
                for i in range(len(block_bounds(size, start, block_size)))
            ]
            files[name] = WrittenFile(size, start, "xxh3-128", digests)
        specs = (
            {kind: [(s.name, s.dtype, list(s.shape)) for s in plan.specs[kind].values()] for kind in KINDS}
            if rank == 0
            else {}
        )
        out.append(Manifest(rank, world, block_size, files, held[rank], specs))
    return out


def make_sparse_files(iter_dir: str, manifests: list[Manifest]) -> None:
    """The shard files with their reported sizes and no data blocks (the commit only stats them)."""
    os.makedirs(iter_dir, exist_ok=True)
    for manifest in manifests:
        for name, info in manifest.files.items():
            with open(os.path.join(iter_dir, name), "wb") as f:
                f.truncate(info.size)


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
    return {
        "global_step": ITERATION,
        "global_batch_size": 4 * world,
        "step_num": ITERATION,
        "epoch_num": 0,
        "consumed_samples": ITERATION * 4 * world,
        "loss_scale": 1.0,
    }


SIM_CONFIG = {"checkpoint": {"prefix": PREFIX, "save_path": "<sim>", "save_max": 5}, "note": "scale simulation"}


def commit(plan: SavePlan, root: str, block_size: int = CHECKSUM_BLOCK) -> tuple[dict, list[dict], CountingStorage]:
    """Every rank's manifest, sparse shard files, and the driver's real commit over them."""
    manifests = manifests_for(plan, shard_sizes(plan), block_size)
    make_sparse_files(paths.iteration_dir(root, ITERATION), manifests)
    storage = CountingStorage(LocalStorage())
    meta = commit_iteration(
        storage,
        root,
        ITERATION,
        manifests,
        common_json(plan.world_size),
        prefix=PREFIX,
        config=SIM_CONFIG,
        job_id="sim",
    )
    return meta, manifests, storage


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

    `checked` are the files it reads checksum blocks of: all of them for a file it verifies, its
    dealt blocks under load_balanced. `takes` are the element ranges it gets for itself. Tensors in
    `allreduced` (FSDP: the 0-d steps) it gets from the one all-reduce instead; `pooled` are the
    pieces of them it copies into that all-reduce, from the files it verifies.
    """

    rank: int
    checked: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    takes: list[tuple[str, str, int, int]] = field(default_factory=list)  # (file, tensor, lo, hi)
    ranged: dict[str, int] = field(default_factory=dict)  # file -> number of range reads (one per piece)
    # (file, tensor, lo, hi) copied into the all-reduce
    pooled: list[tuple[str, str, int, int]] = field(default_factory=list)
    # tensor -> its bytes in the packed buffer (8-byte aligned)
    allreduced: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    requests: int = 0

    @property
    def files_touched(self) -> int:
        return len(self.checked) + len(self.ranged)

    @property
    def allreduce_bytes(self) -> int:
        return sum(self.allreduced.values())


def pool_bytes(spec: TensorSpec) -> int:
    """A pooled tensor's slot in `loader.StateLoader._pool`'s packed buffer: its bytes rounded up to 8."""
    return -(-spec.nbytes // 8) * 8


def load_roles(specs: dict[str, TensorSpec], new_world: int, *, fsdp: bool) -> tuple[bool, set[str]]:
    """(replicated, pooled) for one kind, as `restore._load` and `StateLoader.load` decide them.

    Under FSDP every tensor with a shape is a dim-0 shard live (the live tensor is a DTensor of
    that global shape); the rest (the 0-d steps) are `shared`: every rank wants them whole. All
    shared (DDP) = replicated: direct or load_balanced. Otherwise the shared ones are pooled
    (verifiers copy them out, one all-reduce), unless there is a single loading rank.
    """
    shared = {n for n, s in specs.items() if not (fsdp and s.shape)}
    replicated = len(shared) == len(specs)
    return replicated, (set() if replicated or new_world == 1 else shared)


def load_plan(
    it: Iteration,
    new_world: int,
    rank: int,
    *,
    fsdp: bool,
    balanced: bool,
    owners: dict[tuple[str, int], int] | None = None,
) -> LoadPlan:
    """Rank `rank` of `new_world` loading iteration `it`: each tensor's `needed_range` (its dim-0 chunk
    of a sharded tensor under FSDP, else all of it), from the pieces `plan.overlaps` finds. `owners`
    (load_balanced: (file, block) -> dealing rank) may be passed in when timing many ranks."""
    plan = LoadPlan(rank)
    wanted: dict[str, list[int]] = defaultdict(list)  # file -> bytes of each range read
    for kind in it.tensors:
        specs = it.specs(kind)
        replicated, pooled = load_roles(specs, new_world, fsdp=fsdp)
        files = it.shard_files(kind)
        verified = set()
        if balanced and replicated:  # one deal over both kinds' checksum blocks; each read by its owner, then broadcast
            owners = owners or balanced_owners(it, KINDS, new_world)
            for name in files:
                blocks = it.files[name].blocks(it.block_size)
                mine = [i for i in range(len(blocks)) if owners[name, i] == rank]
                if mine:
                    plan.checked.append(name)
                    plan.bytes_read += sum(blocks[i][1] - blocks[i][0] for i in mine)
                    plan.requests += CHECKED_FILE_REQUESTS + len(consecutive_runs(mine))
                if len(mine) < len(blocks):
                    plan.received.append(name)
        else:  # this rank verifies (reads whole) the files of saving ranks s with s % W' == rank
            verified = {n for n in files if it.files[n].rank % new_world == rank}
            for name in sorted(verified):
                plan.checked.append(name)
                plan.bytes_read += it.files[name].size
                plan.requests += CHECKED_FILE_REQUESTS + 1
        for name, spec in specs.items():
            start, numel = needed_range(spec, fsdp and bool(spec.shape), new_world, rank)
            if name in pooled:
                plan.allreduced[name] = pool_bytes(spec)
            for file, piece in overlaps(list(it.tensors[kind][name].pieces), start, numel):
                lo, hi = max(start, piece.start), min(start + numel, piece.start + piece.numel)
                if name in pooled:  # only the file's verifier copies it out of its stream; the all-reduce does the rest
                    if file in verified:
                        plan.pooled.append((file, name, lo, hi))
                    continue
                plan.takes.append((file, name, lo, hi))
                if file not in verified and not (balanced and replicated):
                    wanted[file].append((hi - lo) * spec.itemsize)
    plan.checked.sort()
    plan.received.sort()
    for file, reads in wanted.items():
        plan.ranged[file] = len(reads)
        plan.bytes_read += sum(reads)
        plan.requests += len(reads)
    return plan


# --------------------------------------------------------------------------- correctness checks


def _assert_tiles(intervals: list[tuple[int, int]], start: int, end: int, what: str) -> None:
    pos = start
    for lo, hi in intervals:
        assert lo == pos and hi > lo, (
            f"{what}: element {pos} is {'covered twice' if lo < pos else 'missing'} ({lo}, {hi})"
        )
        pos = hi
    assert pos == end, f"{what}: covers [{start}, {pos}) of [{start}, {end})"


def check_save_coverage(plan: SavePlan) -> None:
    """Every element of every tensor is in exactly one rank's share, in whole rows."""
    for kind, specs in plan.specs.items():
        pieces = defaultdict(list)
        for rank in range(plan.world_size):
            for p in plan.share(kind, rank):
                spec = specs[p.name]
                assert p.numel > 0 or not spec.numel, f"empty piece {p} in rank {rank}'s share"
                assert not spec.shape or (p.start % spec.row_numel == 0 and p.numel % spec.row_numel == 0), (
                    f"{p} is not whole rows"
                )
                if p.numel:
                    pieces[p.name].append((p.start, p.start + p.numel))
        for name, spec in specs.items():
            _assert_tiles(sorted(pieces.get(name, [])), 0, spec.numel, f"save plan W={plan.world_size}: {name}")


def check_load_plan(it: Iteration, plan: LoadPlan, new_world: int, *, fsdp: bool, balanced: bool) -> None:
    """The plan gets exactly the elements its rank needs, each from a piece its file really holds.

    Tensors it gets from the all-reduce are checked across all ranks by `check_pooled`; here: it
    gets nothing of them itself, and what it copies into the all-reduce comes from a file it verifies.
    """
    kinds = {name: kind for kind in it.tensors for name in it.tensors[kind]}

    def assert_held(file: str, name: str, lo: int, hi: int) -> None:
        holds = [p for f, p in it.tensors[kinds[name]][name].pieces if f == file]
        assert len(holds) == 1 and holds[0].start <= lo < hi <= holds[0].start + holds[0].numel, (
            f"rank {plan.rank}: {file} holds no piece of {name} with elements [{lo}, {hi})"
        )

    available = set(plan.checked) | set(plan.ranged) | set(plan.received)
    got = defaultdict(list)
    for file, name, lo, hi in plan.takes:
        assert file in available, f"rank {plan.rank}: takes {name} from {file}, which it neither reads nor receives"
        assert name not in plan.allreduced, f"rank {plan.rank}: reads {name} itself, which the all-reduce brings"
        assert_held(file, name, lo, hi)
        got[name].append((lo, hi))
    for file, name, lo, hi in plan.pooled:
        assert file in plan.checked and file not in plan.ranged, (
            f"rank {plan.rank}: copies {name} out of {file}, which it does not verify"
        )
        assert name in plan.allreduced
        assert_held(file, name, lo, hi)
    for kind in it.tensors:
        specs = it.specs(kind)
        _, pooled = load_roles(specs, new_world, fsdp=fsdp)
        assert pooled == {n for n in plan.allreduced if n in specs}, (
            f"rank {plan.rank}: pools {sorted(plan.allreduced)}"
        )
        for name, spec in specs.items():
            start, numel = needed_range(spec, fsdp and bool(spec.shape), new_world, plan.rank)
            if name in pooled:
                assert (start, numel) == (0, spec.numel), f"{name} is pooled but rank {plan.rank} needs only part of it"
                continue
            _assert_tiles(
                sorted(got.get(name, [])), start, start + numel, f"load plan rank {plan.rank}/{new_world}: {name}"
            )
    if balanced and not fsdp:
        assert set(plan.checked) | set(plan.received) == set(it.files) and not plan.ranged


def check_pooled(it: Iteration, plans: list[LoadPlan], new_world: int, *, fsdp: bool) -> int:
    """The all-reduce gives every rank its pooled tensors whole: every rank packs the same tensors into the
    same buffer (8-byte slots), every pooled piece is copied by exactly one rank (its file's verifier), and
    those copies tile each tensor. Returns the packed bytes (0: no all-reduce)."""
    assert len(plans) == new_world
    layouts = {tuple(p.allreduced.items()) for p in plans}
    assert len(layouts) == 1, "ranks pack different all-reduce buffers"
    specs = {n: s for kind in it.tensors for n, s in it.specs(kind).items()}
    expected = {
        n: pool_bytes(specs[n])
        for kind in it.tensors
        for n in sorted(load_roles(it.specs(kind), new_world, fsdp=fsdp)[1])
    }
    assert plans[0].allreduced == expected, "the all-reduce buffer is not the pooled tensors, 8-byte aligned"
    copies = Counter(c for p in plans for c in p.pooled)
    twice = [c for c, n in copies.items() if n > 1]
    assert not twice, f"pooled pieces copied by more than one rank: {twice[:3]}"
    for file, _, _, _ in copies:
        owner = it.files[file].rank % new_world
        assert any(c[0] == file for c in plans[owner].pooled), (
            f"{file}'s pooled pieces are not copied by its verifier {owner}"
        )
    by_tensor = defaultdict(list)
    for file, name, lo, hi in copies:
        by_tensor[name].append((lo, hi))
    for name in expected:
        _assert_tiles(
            sorted(by_tensor.get(name, [])),
            0,
            specs[name].numel,
            f"all-reduce over {new_world} ranks (from {it.world_size}): {name}",
        )
    return sum(expected.values())


def check_shard_sizes(plan: SavePlan, sizes) -> None:
    """`shard_sizes` equals every rank's `rank_shards`."""
    for rank in range(plan.world_size):
        for shard in rank_shards(plan, rank):
            s = sizes[shard.kind]
            assert (shard.data, shard.header, len(shard.pieces)) == (
                s["data"][rank],
                s["header"][rank],
                s["pieces"][rank],
            ), f"closed-form write totals differ from SavePlan.share at rank {rank} of {plan.world_size} ({shard.kind})"


# Small mode's checksum block: the tiny decoder's files hold 1 to ~500 blocks each, and
# load_balanced meets both of `loader.divide_blocks`' cases (runs at few ranks, a deal at many).
SMALL_BLOCK = 4096


def check_small(tmp: str) -> dict:
    """Correctness only (CI): the save plan, the closed-form totals, the commit round trip, every rank's load plan."""
    started = time.perf_counter()
    cases = [(1, 3), (3, 1), (4, 3), (5, 7), (7, 5), (16, 12), (48, 36), (64, 48)]
    checked = Counter()
    for fsdp in (False, True):
        specs = state_specs(TINY, fsdp)
        for world, new_world in cases:
            plan = SavePlan(specs, world)
            check_save_coverage(plan)
            sizes = shard_sizes(plan)
            check_shard_sizes(plan, sizes)
            assert sum(int(sizes[k]["data"].sum()) for k in KINDS) == sum(s.nbytes for k in KINDS for s in specs[k])
            checked["save plans"] += 1
            root = os.path.join(tmp, f"{'fsdp' if fsdp else 'ddp'}-{world}-{new_world}")
            _, manifests, storage = commit(plan, root, SMALL_BLOCK)
            assert storage.calls["size"] == 2 * world and storage.calls["write_atomic"] == 4
            it = open_iteration(LocalStorage(), root, ITERATION)
            for kind in KINDS:
                assert it.specs(kind) == {
                    s.name: TensorSpec(s.name, s.dtype, s.shape, s.itemsize) for s in specs[kind]
                }, "metadata.json does not round-trip the tensor specs"
                assert sum(len(t.pieces) for t in it.tensors[kind].values()) == sum(
                    len(m.chunks[kind]) for m in manifests
                )
            assert chunk_count(plan) == sum(len(t.pieces) for kind in KINDS for t in it.tensors[kind].values())
            assert LocalStorage().read_bytes(paths.tracker_path(root)) == f"{ITERATION}\n".encode()
            checked["commits"] += 1
            for balanced in (False, True):
                owners = balanced_owners(it, KINDS, new_world) if balanced else None
                plans = []
                for rank in range(new_world):
                    plans.append(load_plan(it, new_world, rank, fsdp=fsdp, balanced=balanced, owners=owners))
                    check_load_plan(it, plans[-1], new_world, fsdp=fsdp, balanced=balanced)
                    checked["load plans"] += 1
                packed = check_pooled(it, plans, new_world, fsdp=fsdp)
                assert (packed > 0) == (fsdp and new_world > 1), (
                    f"all-reduce of {packed} bytes ({world}->{new_world}, fsdp={fsdp})"
                )
                if packed:
                    steps = [s for s in specs[paths.OPTIM_KIND] if not s.shape]
                    assert sorted(plans[0].allreduced) == sorted(s.name for s in steps) and packed == 8 * len(steps)
                    checked["all-reduces"] += 1
            shutil.rmtree(root)
    # A commit that finds a file of the wrong size refuses before writing anything.
    plan = SavePlan(state_specs(TINY, False), 4)
    manifests = manifests_for(plan, shard_sizes(plan))
    root = os.path.join(tmp, "short")
    make_sparse_files(paths.iteration_dir(root, ITERATION), manifests)
    os.truncate(os.path.join(paths.iteration_dir(root, ITERATION), paths.shard_filename(PREFIX, "opt", 2, 4)), 10)
    try:
        commit_iteration(
            LocalStorage(), root, ITERATION, manifests, common_json(4), prefix=PREFIX, config=SIM_CONFIG, job_id="sim"
        )
        raise AssertionError("a commit with a truncated shard went through")
    except RuntimeError as exc:
        assert "ckpt-opt-0000002-0000004.safetensors" in str(exc), exc
    assert not os.path.exists(paths.tracker_path(root)) and not os.path.exists(
        paths.join(paths.iteration_dir(root, ITERATION), paths.METADATA)
    )
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


def balance(values: np.ndarray) -> float:
    mean = float(values.mean())
    return round(float(values.max()) / mean, 4) if mean else 1.0


# Chunks beyond which a commit is not simulated here: every chunk is one JSON entry of about 200
# bytes in metadata.json, and the driver and every rank hold the parsed file.
MAX_CHUNKS = 2_000_000


def measure(world: int, fsdp: bool, tmp: str, *, sample_ranks: int, max_chunks: int) -> dict:
    tag = "fsdp" if fsdp else "ddp"
    specs = state_specs(LLAMA_70B, fsdp)
    new_world = world * 3 // 4
    r: dict = {"world": world, "layout": tag, "load_world": new_world}
    log = lambda msg: print(f"  [{world} {tag}] {msg}", flush=True)  # noqa: E731

    plan, r["save_plan_build_s"], r["save_plan_build_s_runs"] = best(SavePlan, specs, world)
    probe = sorted({0, world // 2, world - 1})
    r["save_plan_rank_s"] = max(best(rank_shards, plan, rank)[1] for rank in probe)
    sizes, r["save_totals_closed_form_s"] = timed(shard_sizes, plan)
    for rank in random.Random(world).sample(range(world), min(world, sample_ranks)) + probe:
        for shard in rank_shards(plan, rank):
            assert shard.data == sizes[shard.kind]["data"][rank] and shard.header == sizes[shard.kind]["header"][rank]
    written = sizes[paths.MODEL_KIND]["size"] + sizes[paths.OPTIM_KIND]["size"]
    r["checkpoint_bytes"] = int(written.sum())
    r["write_balance"] = balance(written)
    r["write_max_rank_bytes"] = int(written.max())
    r["write_mean_rank_bytes"] = float(written.mean())
    r["ranks_writing_no_data"] = int(((sizes["model"]["data"] + sizes["opt"]["data"]) == 0).sum())
    r["chunks"] = chunk_count(plan)
    log(
        f"save plan {r['save_plan_build_s']:.2f} s, one rank's share {r['save_plan_rank_s']:.3f} s, write balance "
        f"{r['write_balance']}, {r['chunks']:,} chunks"
    )
    if r["chunks"] > max_chunks:
        r["not_committed"] = f"{r['chunks']:,} chunks: metadata.json not simulated (over --max-chunks {max_chunks:,})"
        log(r["not_committed"])
        return r

    root = os.path.join(tmp, f"{tag}-{world}")
    tracemalloc.start()
    manifests = manifests_for(plan, sizes)
    r["driver_manifest_bytes"] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    iter_dir = paths.iteration_dir(root, ITERATION)
    make_sparse_files(iter_dir, manifests)
    storage = CountingStorage(LocalStorage())
    meta, r["commit_s"], r["commit_s_runs"] = best(
        commit_iteration,
        storage,
        root,
        ITERATION,
        manifests,
        common_json(world),
        prefix=PREFIX,
        config=SIM_CONFIG,
        job_id="sim",
    )
    r["commit_storage_calls"] = {k: v // REPEATS for k, v in storage.calls.items()}
    path = paths.join(iter_dir, paths.METADATA)
    blob, r["metadata_serialize_s"], _ = best(dumps, meta)
    _, r["metadata_write_atomic_s"], _ = best(LocalStorage().write_atomic, path + ".sim", blob)
    os.unlink(path + ".sim")
    r["metadata_bytes"] = os.path.getsize(path)
    it, r["metadata_open_s"], _ = best(open_iteration, LocalStorage(), root, ITERATION)  # read, parse, check
    log(f"commit {r['commit_s']:.2f} s, metadata {r['metadata_bytes'] / 1e6:.1f} MB, open {r['metadata_open_s']:.2f} s")
    del manifests

    load_probe = sorted({0, new_world // 2, new_world - 1})
    sample = sorted(set(random.Random(new_world).sample(range(new_world), min(new_world, sample_ranks)) + load_probe))
    r["load_sampled_ranks"] = len(sample)
    for key, balanced in (("direct", False), ("lb", True)):
        if balanced and fsdp:
            continue  # load_balanced applies to replicated targets only: under FSDP it changes nothing
        owners, r[f"load_deal_s_{key}"] = timed(balanced_owners, it, KINDS, new_world) if balanced else (None, 0.0)
        r[f"load_plan_rank_s_{key}"] = max(
            best(load_plan, it, new_world, rank, fsdp=fsdp, balanced=balanced, owners=owners)[1] for rank in load_probe
        )
        plans = [load_plan(it, new_world, rank, fsdp=fsdp, balanced=balanced, owners=owners) for rank in sample]
        for name, values in (
            ("bytes", [p.bytes_read for p in plans]),
            ("requests", [p.requests for p in plans]),
            ("files", [p.files_touched for p in plans]),
        ):
            r[f"read_{name}_{key}"] = {"max": max(values), "mean": round(float(np.mean(values)), 1)}
        log(
            f"load {key}: one rank's plan {r[f'load_plan_rank_s_{key}']:.3f} s, sampled ranks read at most "
            f"{r[f'read_bytes_{key}']['max'] / 1e9:.1f} GB in {r[f'read_requests_{key}']['max']:,} requests"
        )
    pool = load_plan(it, new_world, 0, fsdp=fsdp, balanced=False).allreduced
    r["allreduce"] = {"tensors": len(pool), "bytes_per_rank": sum(pool.values()), "calls": int(bool(pool))}
    shutil.rmtree(root)
    return r


# --------------------------------------------------------------------------- report


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def table(results: dict) -> str:
    worlds = sorted(results["worlds"], key=int)
    cell = lambda w, tag: results["worlds"][w][tag]  # noqa: E731

    def row(label: str, fn) -> str:
        return f"| {label} | " + " | ".join(fn(w) for w in worlds) + " |"

    def both(key: str, fmt) -> callable:
        return lambda w: " / ".join(fmt(cell(w, tag)[key]) if key in cell(w, tag) else "-" for tag in ("ddp", "fsdp"))

    return "\n".join(
        [
            "| saving ranks → loading ranks | "
            + " | ".join(f"{int(w):,} → {cell(w, 'ddp')['load_world']:,}" for w in worlds)
            + " |",
            "|---|" + "---|" * len(worlds),
            row("save plan, built once, s (DDP / FSDP)", both("save_plan_build_s", lambda v: f"{v:.3f}")),
            row("one rank's share in file order, s (DDP / FSDP)", both("save_plan_rank_s", lambda v: f"{v:.3f}")),
            row("write balance max/mean (DDP / FSDP)", both("write_balance", lambda v: f"{v:.3f}")),
            row("chunks metadata.json lists (DDP / FSDP)", both("chunks", lambda v: f"{v:,}")),
            row("metadata.json size (DDP / FSDP)", both("metadata_bytes", fmt_bytes)),
            row("driver commit, s (DDP / FSDP)", both("commit_s", lambda v: f"{v:.2f}")),
            row("metadata.json read + parse + check, s (DDP / FSDP)", both("metadata_open_s", lambda v: f"{v:.2f}")),
            row(
                "driver storage calls per commit (DDP)",
                lambda w: (
                    f"{cell(w, 'ddp')['commit_storage_calls'].get('size', 0):,} stat + "
                    f"{cell(w, 'ddp')['commit_storage_calls'].get('write_atomic', 0)} atomic writes"
                    if "commit_storage_calls" in cell(w, "ddp")
                    else "-"
                ),
            ),
            row(
                "one rank's load plan, s: DDP direct / DDP load_balanced / FSDP",
                lambda w: " / ".join(
                    f"{cell(w, t).get(k, float('nan')):.3f}"
                    for t, k in (
                        ("ddp", "load_plan_rank_s_direct"),
                        ("ddp", "load_plan_rank_s_lb"),
                        ("fsdp", "load_plan_rank_s_direct"),
                    )
                ),
            ),
            row(
                "largest read of a sampled rank: DDP direct / load_balanced / FSDP",
                lambda w: " / ".join(
                    fmt_bytes(cell(w, t)[k]["max"]) if k in cell(w, t) else "-"
                    for t, k in (("ddp", "read_bytes_direct"), ("ddp", "read_bytes_lb"), ("fsdp", "read_bytes_direct"))
                ),
            ),
            row(
                "most requests of a sampled rank: DDP direct / load_balanced / FSDP",
                lambda w: " / ".join(
                    f"{cell(w, t)[k]['max']:,}" if k in cell(w, t) else "-"
                    for t, k in (
                        ("ddp", "read_requests_direct"),
                        ("ddp", "read_requests_lb"),
                        ("fsdp", "read_requests_direct"),
                    )
                ),
            ),
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny decoder, small worlds, correctness only (CI, seconds)")
    ap.add_argument("--worlds", default="1024,4096,16384", help="comma list of saving world sizes (full mode)")
    ap.add_argument(
        "--out", default=None, help="result JSON (default benchmarks/scale_results.json; none with --small)"
    )
    ap.add_argument("--dir", default=None, help="where the sparse shard files go (default: a temp dir)")
    ap.add_argument(
        "--sample-ranks", type=int, default=24, help="loading ranks whose plans are computed besides the probes"
    )
    ap.add_argument(
        "--max-chunks",
        type=int,
        default=MAX_CHUNKS,
        help="simulate the commit and the load only up to this many chunks",
    )
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
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "load_average_at_start": os.getloadavg(),
            },
            "model": {
                "params": sum(s.numel for s in specs["model"]),
                "tensors": {k: len(v) for k, v in specs.items()},
                "checkpoint_data_bytes": sum(s.nbytes for k in KINDS for s in specs[k]),
            },
            "worlds": {},
        }
        for world in (int(w) for w in args.worlds.split(",")):
            results["worlds"][str(world)] = {
                "fsdp" if fsdp else "ddp": measure(
                    world, fsdp, tmp, sample_ranks=args.sample_ranks, max_chunks=args.max_chunks
                )
                for fsdp in (False, True)
            }
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
