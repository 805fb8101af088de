"""The scale simulation in its small mode (correctness only, seconds), and the scaling fixes it relies on.

No timing is asserted: the measured table lives in benchmarks/README.md.
"""

from __future__ import annotations

import functools
import random

import pyarrow.fs as pafs
import pytest

from benchmarks import scale_sim
from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.commit import commit_iteration
from ray_resume.checkpoint.format.plan import SavePlan, TensorSpec, format4_pieces, overlaps
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.format.parse import parse_iteration
from ray_resume.checkpoint.format.schema import parse_json
from ray_resume.checkpoint.io.storage import LocalStorage, storage_for


def test_small_mode_covers_every_byte_and_every_rank_need(tmp_path):
    """`--small`: save plans tile every tensor in whole rows, the closed-form write totals equal every
    rank's share, metadata.json round-trips through the real commit and reader, and every rank's load
    plan (DDP/FSDP, load_balanced on/off, shrinking and growing) gets exactly what it needs (FSDP's 0-d
    steps: copied once each by their file's verifier, then one all-reduce)."""
    assert scale_sim.main(["--small", "--dir", str(tmp_path)]) == 0
    assert not list(tmp_path.iterdir())  # the sparse shard files are cleaned up


def _fsdp_iteration(world: int, tmp_path) -> tuple:
    specs = scale_sim.state_specs(scale_sim.TINY, fsdp=True)
    root = str(tmp_path / f"fsdp-{world}")
    scale_sim.commit(SavePlan(specs, world), root)
    return open_iteration(LocalStorage(), root, scale_sim.ITERATION), specs


@pytest.mark.parametrize("world", [2, 5, 16])
def test_fsdp_load_on_the_saving_world_size_reads_only_own_files(world, tmp_path):
    """As loader.StateLoader since the steps are pooled (tests/test_fsdp.py checks the real loader):
    on the saving world size each FSDP rank reads its own two files whole and touches no other file,
    and the 0-d steps come from one all-reduce of 8 bytes per step."""
    it, specs = _fsdp_iteration(world, tmp_path)
    steps = sorted(s.name for s in specs[paths.OPTIM_KIND] if not s.shape)
    plans = [scale_sim.load_plan(it, world, r, fsdp=True, balanced=False) for r in range(world)]
    for rank, plan in enumerate(plans):
        own = sorted(paths.shard_filename(scale_sim.PREFIX, k, rank, world) for k in scale_sim.KINDS)
        assert plan.checked == own and not plan.ranged and plan.files_touched == 2
        assert plan.bytes_read == sum(it.files[f].size for f in own)
        assert plan.requests == 2 * (scale_sim.CHECKED_FILE_REQUESTS + 1)
        assert sorted(plan.allreduced) == steps and plan.allreduce_bytes == 8 * len(steps)
    assert scale_sim.check_pooled(it, plans, world, fsdp=True) == 8 * len(steps)


def test_check_pooled_refuses_a_step_copied_twice_or_by_nobody(tmp_path):
    it, _ = _fsdp_iteration(6, tmp_path)
    new_world = 4
    plans = [scale_sim.load_plan(it, new_world, r, fsdp=True, balanced=False) for r in range(new_world)]
    scale_sim.check_pooled(it, plans, new_world, fsdp=True)
    copy = next(p.pooled[0] for p in plans if p.pooled)
    twice = [
        scale_sim.LoadPlan(p.rank, p.checked, p.received, p.takes, p.ranged, list(p.pooled), dict(p.allreduced))
        for p in plans
    ]
    twice[(next(i for i, p in enumerate(plans) if copy in p.pooled) + 1) % new_world].pooled.append(copy)
    with pytest.raises(AssertionError, match="more than one rank"):
        scale_sim.check_pooled(it, twice, new_world, fsdp=True)
    for p in plans:
        if copy in p.pooled:
            p.pooled.remove(copy)
    with pytest.raises(AssertionError, match=r"all-reduce over 4 ranks \(from 6\): .*: covers \[0, 0\) of \[0, 1\)"):
        scale_sim.check_pooled(it, plans, new_world, fsdp=True)


@pytest.mark.parametrize("seed", range(20))
def test_format_4_split_layout_gives_every_element_one_rank_within_one_element_of_its_share(seed):
    """Roots of format 4 are still read: its `split` layout laid the replicated tensors, sorted by name,
    end to end and cut the byte stream in W equal ranges; `format4_pieces` must find every element
    there exactly once (also when the stream has fewer bytes than there are ranks) and `overlaps`
    every piece that holds a range."""
    rng = random.Random(seed)
    specs = [
        TensorSpec(
            f"t{rng.randrange(10**6)}.{i}",
            "F32",
            tuple(rng.choice([0, 1, 2, 3, 5, 17, 40]) for _ in range(rng.randint(0, 3))),
            rng.choice([1, 2, 4, 8]),
        )
        for i in range(rng.randint(0, 25))
    ]
    layouts = {s.name: "dim0" if s.shape and rng.random() < 0.3 else "split" for s in specs}
    for world in (1, 2, 3, 7, 64, rng.randint(1, 500)):
        placed = format4_pieces(specs, layouts, world)
        written = [0] * world
        for spec in specs:
            pieces = sorted(placed.get(spec.name, []), key=lambda rp: rp[1].start)
            at = 0
            for rank, piece in pieces:
                assert piece.start == at and piece.numel > 0
                at += piece.numel
                written[rank] += piece.numel * spec.itemsize
            assert at == spec.numel
            if spec.numel:
                start = rng.randrange(spec.numel)
                numel = rng.randint(1, spec.numel - start)
                expected = [(str(r), p) for r, p in pieces if p.start < start + numel and p.start + p.numel > start]
                assert overlaps([(str(r), p) for r, p in pieces], start, numel) == expected
        split = sum(s.nbytes for s in specs if layouts[s.name] == "split")
        dim0 = [
            sum(
                p.numel * s.itemsize
                for s in specs
                if layouts[s.name] == "dim0"
                for r, p in placed.get(s.name, [])
                if r == rank
            )
            for rank in range(world)
        ]
        assert all(abs(w - d - split / world) <= 8 for w, d in zip(written, dim0))  # within one element of its share


@pytest.mark.invariant(4)
def test_commit_on_object_storage_checks_sizes_with_one_listing(s3):
    """The driver's size check on S3 is a LIST of the iteration prefix, not a HEAD per file; a file
    missing from the listing or of the wrong size still fails the commit before the tracker moves."""
    root = "s3://ckpts/scale-run"
    storage = storage_for(root, s3)
    world = 3
    plan = SavePlan(scale_sim.state_specs(scale_sim.TINY, fsdp=False), world)
    sizes = scale_sim.shard_sizes(plan)
    manifests = scale_sim.manifests_for(plan, sizes)
    iter_dir = paths.iteration_dir(root, scale_sim.ITERATION)
    for manifest in manifests:
        for name, info in manifest.files.items():
            storage.write_atomic(paths.join(iter_dir, name), b"\0" * info.size)
    names = [n for m in manifests for n in m.files]
    calls = count_storage_calls(storage.backend)
    assert storage.sizes(iter_dir, names + ["absent"]) == {
        **{n: sizes[n.split("-")[1]]["size"][int(n.split("-")[2])] for n in names},
        "absent": None,
    }
    # One listing for all 6 files; only the name it lacks is asked for by itself.
    assert calls == {"listings": 1, "sizes": [f"{iter_dir}/absent"]}

    commit = functools.partial(
        commit_iteration,
        storage,
        root,
        scale_sim.ITERATION,
        manifests,
        scale_sim.common_json(world),
        prefix="ckpt",
        config=scale_sim.SIM_CONFIG,
        job_id="t",
    )
    short = paths.shard_filename("ckpt", "opt", 1, world)
    storage.write_atomic(paths.join(iter_dir, short), b"x")
    with pytest.raises(RuntimeError, match=short):
        commit()
    assert storage.size(paths.tracker_path(root)) is None

    storage.write_atomic(paths.join(iter_dir, short), b"\0" * manifests[1].files[short].size)
    calls.update(listings=0, sizes=[])
    meta = commit()
    on_disk = parse_json(storage.read_bytes(paths.join(iter_dir, paths.METADATA)), "metadata.json")
    parse_iteration(
        {
            "common": parse_json(storage.read_bytes(paths.join(iter_dir, paths.COMMON)), "common.json"),
            "metadata": on_disk,
        },
        root,
        scale_sim.ITERATION,
    )
    assert on_disk == meta and storage.read_bytes(paths.tracker_path(root)) == f"{scale_sim.ITERATION}\n".encode()
    # The commit checked every size from the listing (and listed once more to remove what it does not list).
    assert calls == {"listings": 2, "sizes": []}


def count_storage_calls(storage) -> dict:
    """Count an ArrowStorage's directory listings and its one-file size calls from here on."""
    calls = {"listings": 0, "sizes": []}
    size = storage.size

    class Listings:
        def __init__(self, fs):
            self.fs = fs

        def get_file_info(self, what):
            calls["listings"] += isinstance(what, pafs.FileSelector)
            return self.fs.get_file_info(what)

        def __getattr__(self, name):
            return getattr(self.fs, name)

    storage.fs = Listings(storage.fs)
    storage.size = lambda path: calls["sizes"].append(path) or size(path)
    return calls
