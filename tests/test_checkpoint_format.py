"""The on-disk format without Ray: plan, names, write -> commit -> read, and refusals."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from conftest import commit_by_hand
from ray_resume.checkpoint.io.lease import LEASE_DIR
from ray_resume.checkpoint.format import names, paths, state
from ray_resume.checkpoint.io import reader
from ray_resume.checkpoint.format.digest import BlockDigests, block_bounds
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.format.plan import SavePlan, TensorSpec
from ray_resume.checkpoint.io.reader import ShardReader, load_rank_extras, plan_reads, read_verified
from ray_resume.checkpoint.io.iterations import check_no_extra_shards, find_committed, open_iteration
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.io.storage import LocalStorage, storage_for
from ray_resume.checkpoint.io.writer import CHECKSUM_BLOCK, save_shards
from ray_resume.model import GPT
from ray_resume.optim import MainParamsOptimizer


def test_names_are_the_specs():
    assert paths.iteration_dirname(200) == "iteration_00000200"
    assert paths.shard_filename("ckpt", "model", 1, 8) == "ckpt-model-0000001-0000008.safetensors"
    assert paths.shard_filename("ckpt", "opt", 7, 8) == "ckpt-opt-0000007-0000008.safetensors"
    assert paths.parse_shard_filename("ckpt-opt-0000007-0000008.safetensors") == {
        "prefix": "ckpt",
        "kind": "opt",
        "rank": 7,
        "world": 8,
    }
    # MindFormers' own names: the prefix is optional, and may hold dashes and the kinds' words.
    assert paths.parse_shard_filename("model-0000000-0000001.safetensors") == {
        "prefix": None,
        "kind": "model",
        "rank": 0,
        "world": 1,
    }
    assert paths.parse_shard_filename("my-opt-7b-model-0000002-0000008.safetensors")["prefix"] == "my-opt-7b"
    # Optimizer state as MindFormers names it: Adam's moments, the fp32 main param; other slots keep torch's name.
    assert [
        names.state_name("fc.weight", slot)
        for slot in ("exp_avg", "exp_avg_sq", "main_param", "step", "momentum_buffer")
    ] == ["adam_m.fc.weight", "adam_v.fc.weight", "main_param.fc.weight", "step.fc.weight", "momentum_buffer.fc.weight"]
    assert names.parse_state_name("adam_v.h.0.attn.weight") == ("h.0.attn.weight", "exp_avg_sq")
    assert names.parse_state_name("global_step") == (None, "global_step")
    assert paths.parse_iteration_dirname("iteration_00000200") == 200
    assert paths.parse_iteration_dirname("iteration_200") is None
    assert (
        paths.join("s3://bucket/run", "iteration_00000001", "common.json")
        == "s3://bucket/run/iteration_00000001/common.json"
    )
    assert paths.tracker_path("/x/ckpt/") == "/x/ckpt/latest_checkpointed_iteration.txt"


@pytest.mark.parametrize("seed", range(8))
def test_save_plan_covers_every_element_once_in_row_chunks_and_balances_bytes(seed, monkeypatch):
    """Every element written by exactly one rank, in chunks of whole rows (N-d boxes); a sharded tensor
    as torch.chunk holds it; a replicated one whole or in equal parts on distinct ranks; and no rank
    holds more replicated bytes than the mean plus one part (what placing the largest first guarantees)."""
    from ray_resume.checkpoint.format import plan as plan_module

    monkeypatch.setattr(plan_module, "MIN_PART", 64)  # small tensors, so that the cutting runs
    rng = random.Random(seed)
    kinds = {
        kind: [
            TensorSpec(f"{kind}{i}", "F32", shape, 4, sharded=bool(shape) and rng.random() < 0.3)
            for i in range(rng.randint(1, 25))
            for shape in [tuple(rng.choice([1, 2, 3, 6, 12, 17, 40, 64]) for _ in range(rng.randint(0, 3)))]
        ]
        for kind in ("model", "opt")
    }
    for world in (1, 2, 3, 7, 64):
        plan = SavePlan(kinds, world)
        for kind, specs in kinds.items():
            covered = {s.name: [0] * s.numel for s in specs}
            for rank in range(world):
                for p in plan.share(kind, rank):
                    spec = plan.specs[kind][p.name]
                    assert p.start % spec.row_numel == 0 and p.numel % spec.row_numel == 0  # whole rows
                    for e in range(p.start, p.start + p.numel):
                        covered[p.name][e] += 1
            assert all(c == 1 for counts in covered.values() for c in counts)
            for spec in specs:
                chunks = plan.chunks(kind, spec.name)
                if spec.sharded:  # as FSDP2's torch.chunk gives each rank its rows
                    held = torch.zeros(spec.shape).chunk(world)
                    assert [(r, p.numel) for r, p in chunks] == [
                        (r, t.numel()) for r, t in enumerate(held) if t.numel()
                    ] or not spec.numel
                else:  # whole, or equal parts on distinct ranks
                    assert len({p.numel for _, p in chunks}) == 1 and len({r for r, _ in chunks}) == len(chunks)
        replicated = [(kind, s) for kind, specs in kinds.items() for s in specs if not s.sharded]
        parts = [p.numel * s.itemsize for kind, s in replicated for _, p in plan.chunks(kind, s.name)]
        held = [
            sum(p.numel * s.itemsize for kind, s in replicated for r, p in plan.chunks(kind, s.name) if r == rank)
            for rank in range(world)
        ]
        # Largest first, a tensor's k parts onto the k ranks holding the least (each then holds at most
        # 1/(W - k + 1) of the replicated bytes placed): no rank above that plus one part.
        cut = max((len(plan.chunks(kind, s.name)) for kind, s in replicated), default=1)
        assert max(held) <= sum(held) / (world - cut + 1) + max(parts, default=0), held


def make_state(seed=0, dtype=torch.float32):
    """A model and its optimizer after one step (so every optimizer slot exists)."""
    torch.manual_seed(seed)
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2).to(dtype)
    opt = MainParamsOptimizer(model, lr=1e-2, weight_decay=0.0)
    opt.backward(model(torch.randint(0, 32, (2, 8))).float().sum())
    opt.step()
    return model, opt


def write_iteration(
    root: Path,
    world: int,
    step: int = 5,
    model=None,
    opt=None,
    block_size: int = CHECKSUM_BLOCK,
    checksum: str = "xxh3-128",
) -> Path:
    """Every rank's shards (written from one process) and the driver's JSON and tracker."""
    model, opt = (model, opt) if model is not None else make_state()
    storage = LocalStorage()
    manifests = [
        save_shards(
            storage,
            str(root),
            step,
            prefix="ckpt",
            rank=r,
            world_size=world,
            model_state=state.model_tensors(model),
            optim_state=opt.state_tensors(),
            rank_extras={"rank": str(r)},
            block_size=block_size,
            checksum=checksum,
        )
        for r in range(world)
    ]
    commit_by_hand(root, step, manifests)
    return Path(paths.iteration_dir(str(root), step))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.invariant(2)
def test_round_trip_restores_every_tensor_bitwise(tmp_path, world):
    model, opt = make_state()
    write_iteration(tmp_path, world, model=model, opt=opt)
    storage = LocalStorage()
    it = open_iteration(storage, str(tmp_path), find_committed(storage, str(tmp_path)))
    loaded = load_state(storage, it, "model")
    for name, t in state.model_tensors(model).items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype
    fresh, fresh_opt = make_state(seed=1)
    fresh_opt.load_state_tensors(load_state(storage, it, "opt"))
    assert fresh_opt.state_tensors().keys() == opt.state_tensors().keys()
    for name, t in opt.state_tensors().items():
        assert torch.equal(fresh_opt.state_tensors()[name], t), name
    assert load_rank_extras(ShardReader(storage, it), world - 1) == {"rank": str(world - 1)}
    # No file holds a byte of replicated state twice: shards add up to the state itself.
    model_bytes = sum(t.numel() * t.element_size() for t in state.model_tensors(model).values())
    stored = sum(len(b) for n, b in read_verified(storage, it, it.shard_files("model")).items())
    assert model_bytes <= stored < model_bytes + world * 4096  # plus one safetensors header per file


# The two checksums take the two hashing paths: xxh3-128 inline, sha256 on helper threads
# (a block's updates on one thread, blocks dealt over several).
CHECKSUMS = {"xxh3-128": lambda b: xxhash.xxh3_128(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("flip", [None, "requested", "skipped"])
@pytest.mark.parametrize("block_size", [CHECKSUM_BLOCK, 100])
@pytest.mark.invariant(7, 12)
def test_checked_read_in_small_reads_fills_the_pieces_and_hashes_every_byte(
    tmp_path, monkeypatch, flip, block_size, checksum
):
    """read_checked with 40-byte reads: requested spans are read into their tensors, the bytes
    between them go through the two alternating scratch buffers, and the digest of each checksum
    block (one data block, or many of 100 bytes) covers all of them: a flipped byte anywhere is
    caught, and the error names its block."""
    monkeypatch.setattr(reader, "READ_BLOCK", 40)
    model, opt = make_state()
    write_iteration(tmp_path, 2, model=model, opt=opt, block_size=block_size, checksum=checksum)
    storage = LocalStorage()
    it = open_iteration(storage, str(tmp_path), find_committed(storage, str(tmp_path)))
    live = state.model_tensors(model)
    wanted = sorted(live)[1::3]  # every third tensor: spans with unrequested bytes between them
    dests, reads = plan_reads(it, "model", {n: (0, live[n].numel()) for n in wanted})
    file = max(reads, key=lambda f: len(reads[f]))
    if flip:
        path = Path(it.path) / file
        header = ShardReader(storage, it).header(file)
        inside = {r.piece.name for r in reads[file]}
        name = next(n for n in sorted(header) if n != "__metadata__" and (n in inside) == (flip == "requested"))
        at = it.files[file].data_start + header[name]["data_offsets"][0] + 1
        data = bytearray(path.read_bytes())
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        block = next(
            i
            for i, (lo, hi) in enumerate(block_bounds(len(data), it.files[file].data_start, block_size))
            if lo <= at < hi
        )
        with pytest.raises(
            CheckpointError, match=rf"{file}: {checksum} does not match metadata.json \(checksum block {block}, "
        ):
            ShardReader(storage, it).read_checked(file, reads[file])
        return
    ShardReader(storage, it).read_checked(file, reads[file])
    for r in reads[file]:
        saved = live[r.piece.name].reshape(-1)[r.lo : r.hi]
        assert torch.equal(dests[r.piece.name][r.lo : r.hi], saved), r.piece.name


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.invariant(12)
def test_each_checksum_block_is_the_digest_of_its_bytes_and_any_subset_can_be_checked(tmp_path, checksum):
    """metadata.json names each file's checksum and lists the digest of the header and of each
    64-byte block of the data section; a reader can check any set of blocks alone, reading only them."""
    directory = write_iteration(tmp_path, 2, block_size=64, checksum=checksum)
    storage = LocalStorage()
    it = open_iteration(storage, str(tmp_path), 5)
    meta = json.loads((directory / paths.METADATA).read_text())["ray_resume"]
    assert meta["block_size"] == it.block_size == 64 and set(meta["files"]) == set(it.files) and len(it.files) == 4
    for name, info in meta["files"].items():
        data = (directory / name).read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        assert info["data_start"] == 8 + length and info["size"] == len(data)
        bounds = block_bounds(len(data), info["data_start"], 64)
        assert (
            bounds[0] == (0, 8 + length)
            and all(hi - lo == 64 for lo, hi in bounds[1:-1])
            and bounds[-1][1] == len(data)
        )
        assert info["checksum"] == checksum and info["digests"] == [
            CHECKSUMS[checksum](data[lo:hi]) for lo, hi in bounds
        ]
    file = max(it.files, key=lambda f: it.files[f].size)
    blocks = block_bounds(it.files[file].size, it.files[file].data_start, 64)
    some = [1, 2, 5, len(blocks) - 1]
    one = ShardReader(storage, it)
    one.read_checked(file, [], blocks=some)
    assert one.bytes_read == sum(blocks[i][1] - blocks[i][0] for i in some)
    data = bytearray((directory / file).read_bytes())
    data[blocks[3][0]] ^= 0xFF  # a block nobody reads here: the others still check out
    (directory / file).write_bytes(bytes(data))
    ShardReader(storage, it).read_checked(file, [], blocks=some)
    with pytest.raises(
        CheckpointError,
        match=rf"{checksum} does not match metadata.json \(checksum block 3, bytes {blocks[3][0]}-{blocks[3][1]}\)",
    ):
        ShardReader(storage, it).read_checked(file, [], blocks=[2, 3])


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("seed", range(3))
def test_block_digests_cut_any_chunking_at_block_ends(seed, checksum):
    rng = random.Random(seed)
    data = os.urandom(rng.randint(1, 5000))
    bounds = block_bounds(len(data), rng.randint(1, len(data)), rng.randint(1, 700))
    digest = BlockDigests(checksum, 0, [hi for _, hi in bounds])
    pos = 0
    while pos < len(data):
        n = rng.randint(0, 900)
        digest.update(data[pos : pos + n])
        pos += n
    assert digest.hexdigests() == [CHECKSUMS[checksum](data[lo:hi]) for lo, hi in bounds]
    short = BlockDigests(checksum, 0, [hi for _, hi in bounds])
    short.update(data[:-1])
    with pytest.raises(ValueError, match="inside the checksum block"):
        short.hexdigests()


def test_sha256_beside_io_matches_hashlib_also_in_a_forked_child():
    """The hashing threads do not survive fork(); a child must start its own instead of
    waiting forever on the parent's (which it did before the at-fork hook)."""
    data = os.urandom(3 << 20)
    digest = BlockDigests("sha256", 0, [len(data)])
    for start in range(0, len(data), 1 << 20):
        digest.update(memoryview(data)[start : start + (1 << 20)])
    assert digest.hexdigests() == [hashlib.sha256(data).hexdigest()]
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if its hash is right
        child = BlockDigests("sha256", 0, [len(data)])
        child.update(data)
        os._exit(0 if child.hexdigests() == [hashlib.sha256(data).hexdigest()] else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on its sha256")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def draws() -> dict:
    """The next values of every generator a rank's state holds, Gaussian caches included."""
    return {
        "torch": torch.rand(3).tolist(),
        "torch_normal": torch.randn(3).tolist(),
        "python": random.random(),
        "python_gauss": random.gauss(0, 1),
        "numpy": np.random.random(2).tolist(),
        "numpy_normal": np.random.standard_normal(),
    }


@pytest.mark.parametrize("cached_gauss", [False, True])
@pytest.mark.invariant(2)
def test_rng_state_round_trips_every_generator(cached_gauss):
    """torch, numpy's legacy global state and python's `random`, each continued exactly. Python's
    `gauss` and numpy's `standard_normal` draw in pairs and cache the second: a restore that drops
    the cache gives another next value."""
    state.seed_everything(7)
    if cached_gauss:
        random.gauss(0, 1)
        np.random.standard_normal()
    saved = json.loads(json.dumps(state.capture_rng()))  # as it travels: text in a safetensors header
    expected = draws()
    state.seed_everything(123)
    draws()
    state.restore_rng(saved)
    assert draws() == expected


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes, the writer lease's record aside: a start on its own
    save_path takes the lease before it reads anything for writing (and gives it back when refused)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != LEASE_DIR
    }


def load_everything(root: Path):
    storage = LocalStorage()
    it = open_iteration(storage, str(root), find_committed(storage, str(root)))
    check_no_extra_shards(storage, it)
    for kind in ("model", "opt"):
        load_state(storage, it, kind)


def _flip_byte(d: Path):
    shard = d / "ckpt-model-0000001-0000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(d: Path):
    shard = d / "ckpt-opt-0000000-0000002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])


def _escape(d: Path):
    meta = json.loads((d / "metadata.json").read_text())
    files = meta["ray_resume"]["files"]
    files["../../etc/passwd"] = files.pop("ckpt-model-0000000-0000002.safetensors")
    (d / "metadata.json").write_text(json.dumps(meta))


def _meta(edit):
    """A damage that edits metadata.json: `edit(metadata, ours, the first model shard's entry)`."""

    def damage(d: Path):
        meta = json.loads((d / "metadata.json").read_text())
        ours = meta["ray_resume"]
        edit(meta, ours, ours["files"]["ckpt-model-0000000-0000002.safetensors"])
        (d / "metadata.json").write_text(json.dumps(meta))

    return damage


def _common(**fields):
    """A damage that rewrites fields of common.json (a file that still parses and passes its own checks)."""

    def damage(d: Path):
        common = json.loads((d / "common.json").read_text())
        common.update(fields)
        (d / "common.json").write_text(json.dumps(common))

    return damage


def _listed_as_another_world(d: Path):
    """A file of another world size listed in metadata.json (and present, with its true size and digests)."""
    meta = json.loads((d / "metadata.json").read_text())
    src = d / "ckpt-model-0000001-0000002.safetensors"
    (d / "ckpt-model-0000002-0000003.safetensors").write_bytes(src.read_bytes())
    meta["ray_resume"]["files"]["ckpt-model-0000002-0000003.safetensors"] = dict(meta["ray_resume"]["files"][src.name])
    (d / "metadata.json").write_text(json.dumps(meta))


def _tensor(edit):
    """A damage that edits MindFormers' state_dict_metadata entry of the model's `tok.weight`."""
    return _meta(lambda m, ours, f: edit(m["state_dict_metadata"]["tok.weight"], m["storage_data"]))


def _moved_chunk(t: dict, storage: dict):
    key = next(k for k in storage if k.startswith("('tok.weight'"))
    storage[key] = [{"file_name": "elsewhere-model-0000000-0000002.safetensors", "storage_rank": 0, "rank_group": [0]}]


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            _flip_byte,
            "ckpt-model-0000001-0000002.safetensors: xxh3-128 does not match metadata.json (checksum block 1, bytes",
        ),
        (_truncate, "ckpt-opt-0000000-0000002.safetensors: size is"),
        (lambda d: (d / "ckpt-opt-0000001-0000002.safetensors").unlink(), "shard listed in metadata.json is missing"),
        (
            lambda d: (d / "ckpt-opt-0000002-0000003.safetensors").write_bytes(b"x"),
            "ckpt-opt-0000002-0000003.safetensors: shard file not listed in metadata.json",
        ),
        (_escape, "file name '../../etc/passwd' points outside the iteration directory"),
        (
            _meta(lambda m, ours, f: f.update(digests=["ab" * 16])),  # one digest for the whole file
            "files['ckpt-model-0000000-0000002.safetensors']: 'digests' must list 2 lowercase hex xxh3-128 digests, one per checksum block",
        ),
        (
            _meta(
                lambda m, ours, f: f.update(checksum="sha256")
            ),  # digests of another length than the named algorithm's
            "files['ckpt-model-0000000-0000002.safetensors']: 'digests' must list 2 lowercase hex sha256 digests, one per checksum block",
        ),
        (
            _meta(lambda m, ours, f: f.update(checksum="crc32c")),
            "files['ckpt-model-0000000-0000002.safetensors']: checksum 'crc32c' is not one this ray_resume knows (xxh3-128, sha256); "
            "use the ray_resume release that wrote it",
        ),
        (
            _meta(lambda m, ours, f: [f.pop("checksum"), f.update(sha256=f.pop("digests"))]),  # a format-3 entry
            "files['ckpt-model-0000000-0000002.safetensors']: checksum None is not one this ray_resume knows",
        ),
        (_meta(lambda m, ours, f: f.update(data_start=f["size"] + 1)), "needs 8 <= data_start <= size"),
        (
            _meta(lambda m, ours, f: ours.update(format_version=3)),
            "format_version 3 is not supported by this ray_resume (it reads 4 and 5)",
        ),
        (
            _common(ckpt_status=1),
            "common.json: ckpt_status is 1 (abnormal, not 0: normal); MindFormers passes such an iteration over",
        ),
        (lambda d: (d / "common.json").write_text("{not json"), "common.json: not valid JSON"),
        (
            lambda d: (d / "metadata.json").unlink(),
            "metadata.json: missing; iteration 5 was never committed or was damaged",
        ),
        (lambda d: (d / "common.json").write_text('{"global_step": 5}'), "common.json: missing field 'epoch_num'"),
        # MindFormers builds CommonInfo(**common.json): a key of ours there would break its loader.
        (
            _common(world_size=2),
            "common.json: field 'world_size' is not one of MindFormers' CommonInfo, whose loader refuses it",
        ),
        # A committed iteration must agree with itself: its step, world size, files and chunks.
        (_common(global_step=4), "common.json: global_step 4 is not this directory's iteration 5"),
        (
            _meta(lambda m, ours, f: ours.update(world_size=3)),
            "files['ckpt-model-0000000-0000002.safetensors'] is not a shard of this 3-rank iteration",
        ),
        (
            _meta(lambda m, ours, f: ours.update(iteration=4)),
            "metadata.json: iteration 4 is not this directory's iteration 5",
        ),
        (
            _listed_as_another_world,
            "metadata.json: files['ckpt-model-0000002-0000003.safetensors'] is not a shard of this 2-rank iteration",
        ),
        (
            _tensor(lambda t, storage: t.update(global_shape=[33, 16])),
            "state_dict_metadata['tok.weight']: its chunks cover 512 of its 528 elements",
        ),
        (
            _tensor(lambda t, storage: t["properties"].update(dtype="Float8E4M3FN")),
            "state_dict_metadata['tok.weight'] needs a known properties.dtype",
        ),
        (
            _tensor(lambda t, storage: t["chunk"][0].update(global_offset=[0, 8])),
            "state_dict_metadata['tok.weight']: a chunk is cut along dimension 1 (tensor parallel), not in rows",
        ),
        (
            _tensor(_moved_chunk),
            "chunk ('tok.weight', (0, 0)) is in ['elsewhere-model-0000000-0000002.safetensors'], which this iteration does not hold",
        ),
        (lambda d: (d.parent / paths.TRACKER).write_text(""), "tracker is empty"),
        (
            lambda d: (d.parent / paths.TRACKER).write_text("abc"),
            "tracker must hold a non-negative iteration number, got 'abc'",
        ),
        (
            lambda d: (d.parent / paths.TRACKER).write_text("-3"),
            "tracker must hold a non-negative iteration number, got '-3'",
        ),
        (
            lambda d: (d.parent / paths.TRACKER).write_text("9"),
            "names iteration 9, but iteration_00000009/ does not exist",
        ),
    ],
)
@pytest.mark.invariant(6, 7, 10)
def test_damaged_checkpoint_is_refused_by_name_and_left_untouched(tmp_path, damage, message):
    directory = write_iteration(tmp_path, world=2)
    damage(directory)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_everything(tmp_path)
    assert message in str(err.value)
    assert tree(tmp_path) == before  # a failed load changes nothing on disk


@pytest.mark.invariant(1)
def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path):
    storage = storage_for(str(tmp_path))
    target = str(tmp_path / "latest_checkpointed_iteration.txt")
    storage.write_atomic(target, b"4\n")
    storage.write_atomic(target, b"8\n")
    assert Path(target).read_bytes() == b"8\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest_checkpointed_iteration.txt"]


@pytest.mark.invariant(6)
def test_unsupported_storage_scheme_is_named():
    with pytest.raises(ValueError, match="storage scheme 'gs'"):
        storage_for("gs://bucket/ckpt")


@pytest.mark.invariant(6)
def test_no_pickle_anywhere_in_the_package():
    """Checkpoints are safetensors and JSON only: nothing in the package may unpickle, but for the one
    file torch writes with pickle, DCP's `.metadata`, read by an unpickler of DCP's classes alone
    (`checkpoint/interop/dcp_checkpoint.py`, tests/test_dcp.py feeds it a pickle that would run code)."""
    package = Path(__file__).resolve().parent.parent / "ray_resume"
    import re

    unpickling = re.compile(r"import pickle|pickle\.loads?\(|cloudpickle|(^|[^.\w])torch\.load\(", re.M)
    offenders = [p.name for p in package.rglob("*.py") if unpickling.search(p.read_text())]
    assert offenders == ["dcp_checkpoint.py"]
    dcp = (package / "checkpoint" / "interop" / "dcp_checkpoint.py").read_text()
    assert re.findall(r"pickle\.\w+", dcp) == ["pickle.Unpickler", "pickle.UnpicklingError"] and "def find_class" in dcp
    assert unpickling.search("x = torch.load(f)") and not unpickling.search("safetensors.torch.load(data)")


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-2, amsgrad=True),  # max_exp_avg_sq besides exp_avg(_sq)
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),  # momentum_buffer
        lambda params: torch.optim.Adagrad(params, lr=1e-2),  # sum
    ],
    ids=["adamw-amsgrad", "sgd-momentum", "adagrad"],
)
@pytest.mark.invariant(2)
def test_every_slot_of_a_torch_optimizer_round_trips(make):
    """Not a fixed slot list: whatever the optimizer keeps per parameter comes back bit for bit."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    optimizer = make(model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randint(0, 32, (2, 8))).float().sum().backward()
        optimizer.step()
    named = list(model.named_parameters())
    saved = state.optim_tensors(named, optimizer)
    fresh = make(model.parameters())
    state.load_optim_tensors(named, fresh, {k: v.clone() for k, v in saved.items()})
    for _, p in named:
        before, after = optimizer.state[p], fresh.state[p]
        assert sorted(before) == sorted(after) and before
        for slot in before:
            assert torch.equal(torch.as_tensor(before[slot]), torch.as_tensor(after[slot])), slot


FORMAT4 = Path(__file__).resolve().parent / "data" / "format4"


@pytest.mark.invariant(2)
def test_a_root_of_format_4_is_still_read_bit_for_bit(tmp_path, capsys):
    """A root the released format 4 wrote (tests/data/format4: 2 ranks, replicated state byte-split
    across them, `{param}.{slot}` names): read with its own rules, every tensor as the ranks held it,
    the optimizer's under today's names, and restored into a live model and optimizer."""
    import shutil

    from safetensors.torch import load_file

    from ray_resume import cli
    from ray_resume.checkpoint.checkpointer import Checkpointer
    from ray_resume.checkpoint.root import CommittedIteration
    from ray_resume.config import Config
    from conftest import tiny_config

    root = tmp_path / "root"
    shutil.copytree(FORMAT4 / "root", root)
    held = load_file(str(FORMAT4 / "held.safetensors"))
    storage = LocalStorage()
    it = open_iteration(storage, str(root), 2)
    assert (it.origin, it.world_size, it.common["consumed_samples"], it.ours["job_id"]) == (
        "ray_resume",
        2,
        16,
        "format4",
    )
    loaded = {
        **{f"model/{n}": t for n, t in load_state(storage, it, "model").items()},
        **{f"opt/{n}": t for n, t in load_state(storage, it, "opt").items()},
    }
    renamed = {
        k if k.startswith("model/") else "opt/" + names.state_name(*k[4:].rsplit(".", 1)): t for k, t in held.items()
    }
    assert loaded.keys() == renamed.keys()
    assert all(torch.equal(loaded[k], renamed[k]) for k in renamed)
    model, opt = make_state(seed=3)
    cfg = Config.from_dict(tiny_config(tmp_path))
    point, _ = Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
        model, opt, CommittedIteration(str(root), 2), full=True
    )
    assert (point.step, point.consumed_samples) == (2, 16)
    assert all(torch.equal(t, held[f"model/{n}"]) for n, t in state.model_tensors(model).items())
    assert all(torch.equal(t, renamed[f"opt/{n}"]) for n, t in opt.state_tensors().items())
    assert (
        cli.main(["verify", str(root)]) == 0 and "sizes and block digests (xxh3-128) match" in capsys.readouterr().out
    )
