"""load_balanced over a real gloo process group (2 processes, no Ray): same state, each byte read once."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import harness
from benchmarks import scale_sim
from ray_resume.checkpoint.loader import (
    StateLoader,
    balanced_owners,
    deal_by_size,
    divide_blocks,
    even_runs,
    open_shared,
    owned_parts,
)
from ray_resume.checkpoint.io.reader import load_rank_extras
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.root import CheckpointRoot
from ray_resume.checkpoint.format.schema import Iteration, StoredFile
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import CHECKSUM_BLOCK
from ray_resume.collectives import decided_by_rank0
from storage_faults import FileProxy
from test_checkpoint_format import make_state, write_iteration

WORLD = 2


def _load(rank: int, root: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    storage = LocalStorage()
    it = open_iteration(storage, root, 5)
    report = {}
    for balanced in (False, True):
        loader = StateLoader(storage, it, rank, WORLD, balanced)
        tensors = {}
        for kind in ("model", "opt"):
            whole = {s.name: (0, s.numel) for s in it.specs(kind).values()}
            tensors.update({f"{kind}/{n}": t for n, t in loader.load(kind, whole, shared=set(whole)).items()})
        data_bytes = loader.bytes_read
        extras = load_rank_extras(loader.reader, rank)
        report[str(balanced)] = {
            "bytes_read": data_bytes,
            "bits": {n: t.reshape(-1).contiguous().view(torch.uint8).tolist() for n, t in tensors.items()},
            "extras": extras,
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.parametrize("block_size", [CHECKSUM_BLOCK, 256])
def test_load_balanced_reads_each_byte_once_and_loads_the_same_state(tmp_path, block_size):
    """3 saving ranks loaded by 2. Direct: each rank reads the files it verifies whole and the data
    of all others. Balanced: every byte once in total, each rank within one block of the mean;
    with 256-byte checksum blocks the cut between the ranks falls inside a file's data."""
    model, opt = make_state()
    directory = write_iteration(tmp_path / "root", world=3, model=model, opt=opt, block_size=block_size)
    init = f"file://{tmp_path / 'pg'}"
    harness.spawn(_load, (str(tmp_path / "root"), init, str(tmp_path)), WORLD)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    it = open_iteration(LocalStorage(), str(tmp_path / "root"), 5)
    files = it.files
    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert total == sum(f.size for f in files.values())
    direct = [
        sum(f.size if f.rank % WORLD == r else f.size - f.data_start for f in files.values()) for r in range(WORLD)
    ]
    assert [r["False"]["bytes_read"] for r in reports] == direct
    balanced = [r["True"]["bytes_read"] for r in reports]
    assert sum(balanced) == total and min(balanced) > 0  # each byte once in total, both ranks share the work
    assert max(balanced) - min(balanced) < 2 * block_size  # each within one block of the mean
    owners = balanced_owners(it, ("model", "opt"), WORLD)
    split = [f for f in files if len({owners[f, i] for i in range(1, len(files[f].digests))}) == WORLD]  # data blocks
    assert bool(split) == (block_size == 256)
    for r, report in enumerate(reports):
        assert report["True"]["bits"] == report["False"]["bits"]  # bit-identical state
        assert report["True"]["extras"] == report["False"]["extras"] == {"rank": str(r)}


def test_even_runs_is_the_best_cut_into_consecutive_runs():
    """Against brute force, on 300 random cases: no cut of the items, in order, into at most W
    consecutive runs has a smaller largest run than `even_runs`' (whose runs are consecutive,
    ranks in order)."""
    rng = random.Random(0)
    for _ in range(300):
        sizes, world = [rng.randint(1, 50) for _ in range(rng.randint(0, 11))], rng.randint(1, 6)
        prefix = list(itertools.accumulate(sizes, initial=0))

        @functools.cache
        def best(i: int, runs: int) -> float:  # smallest largest run for items i.. in `runs` runs
            if i == len(sizes):
                return 0
            return (
                min(max(prefix[j] - prefix[i], best(j, runs - 1)) for j in range(i + 1, len(sizes) + 1))
                if runs
                else math.inf
            )

        owners = even_runs(sizes, world)
        assert len(owners) == len(sizes) and owners == sorted(owners) and all(0 <= o < world for o in owners)
        assert max([sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]) == best(0, world), (
            sizes,
            world,
        )


def test_one_cut_over_both_kinds_gives_each_rank_a_consecutive_run_within_a_block_of_the_mean():
    """4 saving ranks loaded by 3, files of 100 and 200 bytes in 10-byte blocks (a share of 40
    blocks). One cut over the blocks of both kinds, in order: 400 bytes each, every rank's blocks
    consecutive (the 4 model files; 2 opt files; 2 opt files). Cut per kind, the first ranks
    would take an extra block of each."""

    def blocks(size: int) -> int:
        return 1 + -(-(size - 8) // 10)

    files = {
        f"ckpt-{kind}-{r:07d}-0000004.safetensors": {
            "size": size,
            "data_start": 8,
            "checksum": "xxh3-128",
            "digests": ["0" * 32] * blocks(size),
        }
        for kind, size in (("model", 100), ("opt", 200))
        for r in range(4)
    }
    stored = {
        name: StoredFile(name, name.split("-")[1], int(name.split("-")[2]), f["size"], 8, "xxh3-128", f["digests"])
        for name, f in files.items()
    }
    meta = Iteration("root", 5, "root/iteration_00000005", {}, {}, "ray_resume", 4, 10, stored, {}, {})
    owners = balanced_owners(meta, ("model", "opt"), 3)
    order = [
        (f"ckpt-{kind}-{r:07d}-0000004.safetensors", i)
        for kind, size in (("model", 100), ("opt", 200))
        for r in range(4)
        for i in range(blocks(size))
    ]
    assert list(owners) == order
    assert [owners[u] for u in order] == sorted(owners[u] for u in order)  # consecutive runs, rank by rank
    sizes = {(f, i): (8 if i == 0 else min(10, files[f]["size"] - 8 - 10 * (i - 1))) for f, i in owners}
    assert [sum(sizes[u] for u, o in owners.items() if o == r) for r in range(3)] == [400, 400, 400]
    assert {f for (f, _), o in owners.items() if o == 0} == {f for f in files if "-model-" in f}
    model_only = balanced_owners(meta, ("model",), 3)
    # a weights-only load divides only what it reads
    assert sorted({f for f, _ in model_only}) == [f for f in sorted(files) if "-model-" in f]


def test_a_share_of_few_blocks_is_dealt_block_by_block():
    """Under 10 blocks per rank (~100k ranks), runs would leave most of a block of slack on a rank;
    blocks are dealt largest first to the least loaded rank instead."""
    assert divide_blocks([5, 5, 5, 5], 2) == deal_by_size([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    owners = deal_by_size([100, 1, 1, 1, 97], 2)
    assert sorted(sum(s for s, o in zip([100, 1, 1, 1, 97], owners) if o == r) for r in range(2)) == [100, 100]
    many = [4] * 200  # 100 blocks per rank: consecutive runs
    assert divide_blocks(many, 2) == even_runs(many, 2) == [0] * 100 + [1] * 100


def test_each_broadcast_is_a_longest_part_one_rank_read():
    """A requested span over blocks 0-3 read by ranks 0, 0, 1, 1 goes out in two broadcasts, not four."""
    blocks = [(0, 10, ""), (10, 20, ""), (20, 30, ""), (30, 40, "")]
    owner = [0, 0, 1, 1]
    assert list(owned_parts([(5, 35, "r")], blocks, owner.__getitem__)) == [("r", 5, 5, 20, 0), ("r", 5, 20, 35, 1)]
    assert list(owned_parts([(0, 8, "a"), (12, 40, "b")], blocks, owner.__getitem__)) == [
        ("a", 0, 0, 8, 0),
        ("b", 12, 12, 20, 0),
        ("b", 12, 20, 40, 1),
    ]


class _SeekCounting(FileProxy):
    """A file whose seeks are counted: each starts a new streamed read (a ranged GET on S3)."""

    def __init__(self, f, calls: list):
        super().__init__(f)
        self.calls = calls

    def seek(self, pos):
        self.calls.append("read")
        return self.f.seek(pos)


class RequestCountingStorage(LocalStorage):
    """Counts what `benchmarks.scale_sim` counts as storage requests: size checks and streamed reads."""

    def __init__(self):
        self.calls: list[str] = []
        self.opened: set[str] = set()

    def size(self, path):
        self.calls.append("size")
        return super().size(path)

    def open_read(self, path):
        self.opened.add(Path(path).name)
        return _SeekCounting(super().open_read(path), self.calls)


def _count(rank: int, root: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    it = open_iteration(LocalStorage(), root, 5)
    report = {}
    for balanced in (False, True):
        storage = RequestCountingStorage()
        loader = StateLoader(storage, it, rank, WORLD, balanced)
        for kind in ("model", "opt"):
            whole = {s.name: (0, s.numel) for s in it.specs(kind).values()}
            loader.load(kind, whole, shared=set(whole))
        report[str(balanced)] = [loader.bytes_read, len(storage.calls), len(storage.opened)]
    Path(out, f"count{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_scale_simulation_counts_what_the_real_loader_does(tmp_path):
    """benchmarks/scale_sim.py's load plan, run on a real checkpoint's metadata.json, predicts each
    rank's bytes read, storage requests and files touched of the real loader exactly (DDP, 3 -> 2
    ranks, 256-byte checksum blocks, load_balanced off and on)."""
    write_iteration(tmp_path / "root", world=3, block_size=256)
    harness.spawn(_count, (str(tmp_path / "root"), f"file://{tmp_path / 'pg'}", str(tmp_path)), WORLD)
    it = open_iteration(LocalStorage(), str(tmp_path / "root"), 5)
    for rank in range(WORLD):
        real = json.loads((tmp_path / f"count{rank}.json").read_text())
        for balanced in (False, True):
            plan = scale_sim.load_plan(it, WORLD, rank, fsdp=False, balanced=balanced)
            assert real[str(balanced)] == [plan.bytes_read, plan.requests, plan.files_touched], (rank, balanced)


class CountingStorage(LocalStorage):
    """Local storage that notes which JSON files and directories a rank reads."""

    def __init__(self):
        self.calls: list[str] = []

    def read_bytes(self, path: str) -> bytes:
        self.calls.append(Path(path).name)
        return super().read_bytes(path)

    def listdir(self, path: str) -> list[str]:
        self.calls.append(f"list {Path(path).name}")
        return super().listdir(path)


def _open(rank: int, root: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    storage = CountingStorage()
    try:
        it = open_shared(CheckpointRoot(root, storage=storage), 5, rank, WORLD)
        report = {"raw": it.raw, "common": it.common, "path": it.path}
    except CheckpointError as exc:
        report = {"error": str(exc)}
    report["calls"] = storage.calls
    Path(out, f"open{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.parametrize("damaged", [False, True])
@pytest.mark.invariant(12)
def test_only_rank_0_reads_the_iteration_json_and_every_rank_gets_its_verdict(tmp_path, damaged):
    """At thousands of ranks each fetching metadata.json is the bulk of a load's GETs: rank 0 reads
    and checks it (and lists the directory) once, and the others get the same JSON, or the same error."""
    model, opt = make_state()
    directory = write_iteration(tmp_path / "root", world=3, model=model, opt=opt)
    if damaged:
        common = json.loads((directory / "common.json").read_text())
        common["ckpt_status"] = 1
        (directory / "common.json").write_text(json.dumps(common))
    harness.spawn(_open, (str(tmp_path / "root"), f"file://{tmp_path / 'pg'}", str(tmp_path)), WORLD)
    reports = [json.loads((tmp_path / f"open{r}.json").read_text()) for r in range(WORLD)]
    assert reports[0]["calls"][:2] == ["common.json", "metadata.json"]
    assert all(r["calls"] == [] for r in reports[1:])  # nothing read from storage by the other ranks
    if damaged:
        errors = {r["error"] for r in reports}  # one message, rank 0's, on every rank
        assert len(errors) == 1 and "common.json: ckpt_status is 1 (abnormal, not 0: normal)" in errors.pop()
        return
    assert reports[0]["calls"] == ["common.json", "metadata.json", "list iteration_00000005"]
    expected = open_iteration(LocalStorage(), str(tmp_path / "root"), 5)
    for r in reports:
        assert (r["raw"], r["common"], r["path"]) == (expected.raw, expected.common, expected.path)


def _decide(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)

    def decide():
        raise OSError(5, "Input/output error", "s3://bucket/root/latest_checkpointed_iteration.txt")

    try:
        decided_by_rank0(decide, rank, "read the tracker")
    except Exception as exc:  # noqa: BLE001  (what each rank raises is the finding)
        Path(out, f"decided{rank}.json").write_text(json.dumps([type(exc).__name__, str(exc)]))
    dist.destroy_process_group()


def test_a_failure_of_rank_0s_that_is_no_checkpoint_error_reaches_every_rank_as_what_it_is(tmp_path):
    """A storage error where rank 0 decides alone: rank 0 raises it, the others a RuntimeError that names
    it, not a CheckpointError (one of the user's mistakes, which is never retried)."""
    harness.spawn(_decide, (f"file://{tmp_path / 'pg'}", str(tmp_path)), 2)
    raised = [json.loads((tmp_path / f"decided{r}.json").read_text()) for r in range(2)]
    assert raised[0] == [
        "OSError",
        "[Errno 5] Input/output error: 's3://bucket/root/latest_checkpointed_iteration.txt'",
    ]
    assert raised[1] == [
        "RuntimeError",
        "rank 0 could not read the tracker: OSError(5, 'Input/output error')",
    ]
