"""Tests for ray_resume.data: synthetic data, deterministic order, exact resume via Ray Data."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from ray_resume.data.files import _column_array
from ray_resume.data import (
    DataError,
    ReadUnit,
    SampleStream,
    dataset_size,
    ensure_dataset,
    epoch_order,
    plan_lane,
    scan_units,
    write_synthetic,
)

N, L, V = 100, 8, 50
FILES, RGS = 4, 4


@pytest.fixture(scope="module")
def ray_ctx(ray_cluster):
    import ray

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "synth"
    write_synthetic(p, N, L, V, seed=7, files=FILES, row_groups_per_file=RGS)
    return p


def ray_stream(*args, **kwargs) -> SampleStream:
    """A stream whose reads go to Ray Data's read tasks as soon as their processes have started,
    however cheap (by default, reads that cost a rank little stay in it)."""
    return SampleStream(*args, read_tasks_above=0, **kwargs)


def take(stream, k):
    return list(itertools.islice(iter(stream), k))


def ids_of(units, order):
    """Map (unit_index, row) pairs to sample ids for the synthetic dataset (ids in file order)."""
    starts = np.cumsum([0] + [u.num_rows for u in units])
    return starts[order[:, 0]] + order[:, 1]


# ---------------------------------------------------------------- synth


def test_synth_layout_and_schema(ds_path):
    files = sorted(ds_path.glob("*.parquet"))
    assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(FILES)]
    assert not [f for f in ds_path.iterdir() if f.suffix != ".parquet"]  # no tmp leftovers
    all_ids, lens = [], []
    for f in files:
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_row_groups == RGS
        sch = pf.schema_arrow
        assert sch.field("sample_id").type == pa.int64()
        t = sch.field("input_ids").type
        assert pa.types.is_list(t) and t.value_type == pa.int32()
        tbl = pf.read()
        all_ids.append(tbl.column("sample_id").to_numpy())
        lens.extend(pc.list_value_length(tbl.column("input_ids")).to_pylist())
        toks = np.concatenate(tbl.column("input_ids").to_pylist())
        assert toks.min() >= 0 and toks.max() < V
    ids = np.concatenate(all_ids)
    np.testing.assert_array_equal(ids, np.arange(N))
    assert set(lens) == {L + 1}
    units = scan_units(ds_path)
    assert len(units) == FILES * RGS and dataset_size(units) == N


def test_synth_cli_and_learnable(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_resume.data",
            "synth",
            "--out",
            str(out),
            "--samples",
            "40",
            "--seq-len",
            "6",
            "--vocab",
            "20",
            "--seed",
            "3",
            "--files",
            "2",
            "--row-groups-per-file",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert "40" in r.stdout and str(out) in r.stdout
    units = scan_units(out)
    assert len(units) == 6 and dataset_size(units) == 40
    # deterministic for a seed
    write_synthetic(tmp_path / "again", 40, 6, 20, seed=3, files=2, row_groups_per_file=3)
    a = pq.read_table(out / "part-00001.parquet")
    b = pq.read_table(tmp_path / "again" / "part-00001.parquet")
    assert a.equals(b)
    # mostly arithmetic: the next-token difference is constant for most positions
    toks = np.array(pq.read_table(out).column("input_ids").to_pylist())
    d = np.diff(toks, axis=1) % 20
    frac = np.mean(d == np.median(d, axis=1, keepdims=True))
    assert frac > 0.7


# ---------------------------------------------------------------- order (pure)


@pytest.mark.invariant(3)
def test_order_pure(ds_path):
    units = scan_units(ds_path)
    o1 = ids_of(units, epoch_order(units, 1, 0, True))
    o1b = ids_of(units, epoch_order(units, 1, 0, True))
    o2 = ids_of(units, epoch_order(units, 2, 0, True))
    o1e1 = ids_of(units, epoch_order(units, 1, 1, True))
    np.testing.assert_array_equal(o1, o1b)
    assert not np.array_equal(o1, o2)
    assert not np.array_equal(o1, o1e1)
    for o in (o1, o2, o1e1):
        np.testing.assert_array_equal(np.sort(o), np.arange(N))
    np.testing.assert_array_equal(ids_of(units, epoch_order(units, 1, 3, False)), np.arange(N))


@pytest.mark.invariant(3)
def test_stream_order_matches_pure_order(ray_ctx, ds_path):
    units = scan_units(ds_path)
    # gbs = N: one step per epoch
    steps = take(ray_stream(ds_path, 5, True, N, 0, 1, 0), 2)
    for e, b in enumerate(steps):
        np.testing.assert_array_equal(b["sample_id"], ids_of(units, epoch_order(units, 5, e, True)))
        np.testing.assert_array_equal(np.sort(b["sample_id"]), np.arange(N))
    assert not np.array_equal(steps[0]["sample_id"], steps[1]["sample_id"])
    again = take(ray_stream(units, 5, True, N, 0, 1, 0), 1)[0]
    np.testing.assert_array_equal(again["sample_id"], steps[0]["sample_id"])
    other = take(ray_stream(units, 6, True, N, 0, 1, 0), 1)[0]
    assert not np.array_equal(other["sample_id"], steps[0]["sample_id"])
    plain = take(ray_stream(units, 5, False, 30, 0, 1, 0), 4)
    np.testing.assert_array_equal(np.concatenate([b["sample_id"] for b in plain]), np.r_[np.arange(N), np.arange(20)])
    # input_ids belong to the sample ids
    tbl = pq.read_table(ds_path)
    ref = np.array(tbl.column("input_ids").to_pylist(), dtype=np.int32)
    b = steps[0]
    assert b["input_ids"].dtype == np.int32 and b["sample_id"].dtype == np.int64
    assert b["input_ids"].shape == (N, L + 1)
    np.testing.assert_array_equal(b["input_ids"], ref[b["sample_id"]])


# ---------------------------------------------------------------- resume equivalence


@pytest.mark.invariant(3)
def test_resume_equivalence_across_epochs(ray_ctx, ds_path):
    gbs, steps = 16, 12  # 192 samples: crosses the epoch boundary at 100
    full = take(ray_stream(ds_path, 11, True, gbs, 0, 1, 0), steps)
    flat_ids = np.concatenate([b["sample_id"] for b in full])
    flat_tok = np.concatenate([b["input_ids"] for b in full])
    np.testing.assert_array_equal(np.sort(flat_ids[:N]), np.arange(N))  # epoch 0 is a permutation
    assert len(np.unique(flat_ids[N:])) == len(flat_ids) - N  # epoch 1 starts fresh, no repeats
    k = 3
    s = ray_stream(ds_path, 11, True, gbs, 0, 1, k * gbs)
    resumed = take(s, steps - k)
    assert s.position == steps * gbs
    for a, b in zip(full[k:], resumed):
        np.testing.assert_array_equal(a["sample_id"], b["sample_id"])
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    # offset not a multiple of gbs (and spanning the epoch boundary)
    for off in (37, 99):
        r = take(ray_stream(ds_path, 11, True, gbs, 0, 1, off), 4)
        got_ids = np.concatenate([b["sample_id"] for b in r])
        got_tok = np.concatenate([b["input_ids"] for b in r])
        np.testing.assert_array_equal(got_ids, flat_ids[off : off + 4 * gbs])
        np.testing.assert_array_equal(got_tok, flat_tok[off : off + 4 * gbs])


@pytest.mark.invariant(3)
def test_world_size_invariance(ray_ctx, ds_path):
    gbs, steps, start = 16, 8, 37
    ref = take(ray_stream(ds_path, 4, True, gbs, 0, 1, start), steps)
    for w in (2, 4):
        per_rank = [take(ray_stream(ds_path, 4, True, gbs, r, w, start), steps) for r in range(w)]
        for s in range(steps):
            parts = [per_rank[r][s] for r in range(w)]
            assert all(len(p["sample_id"]) == gbs // w for p in parts)
            np.testing.assert_array_equal(np.concatenate([p["sample_id"] for p in parts]), ref[s]["sample_id"])
            np.testing.assert_array_equal(np.concatenate([p["input_ids"] for p in parts]), ref[s]["input_ids"])


# ---------------------------------------------------------------- plan


@pytest.mark.invariant(3)
def test_plan_excludes_units_before_offset(ds_path):
    units = scan_units(ds_path)
    seed, epoch = 9, 2
    order = epoch_order(units, seed, epoch, True)
    unit_seq = [int(u) for u in dict.fromkeys(order[:, 0].tolist())]
    assert plan_lane(units, seed, epoch, True, 1, 0) == [(u, 0, units[u].num_rows) for u in unit_seq]
    for off in (0, 1, 6, 7, 37, 50, 99):
        plan = plan_lane(units, seed, epoch, True, 1, 0, off)
        first_unit, row_start, _ = plan[0]
        # the unit holding position `off` comes first, sliced at the right row
        assert first_unit == order[off, 0]
        before = np.sum(order[:off, 0] == first_unit)
        assert row_start == before
        assert all(rs == 0 and re == units[u].num_rows for u, rs, re in plan[1:])
        # no unit whose rows all lie before the offset is planned
        wholly_before = set(order[:off, 0].tolist()) - {first_unit}
        assert not wholly_before & {u for u, _, _ in plan}
        assert [u for u, _, _ in plan] == unit_seq[unit_seq.index(first_unit) :]
        assert sum(re - rs for _, rs, re in plan) == N - off
    with pytest.raises(ValueError):
        plan_lane(units, seed, epoch, True, 1, 0, N)


@pytest.mark.invariant(3)
def test_plan_with_fake_units():
    units = [ReadUnit("a", 0, 5), ReadUnit("a", 1, 3), ReadUnit("b", 0, 4)]
    assert plan_lane(units, 0, 0, False, 1, 0) == [(0, 0, 5), (1, 0, 3), (2, 0, 4)]
    assert plan_lane(units, 0, 0, False, 1, 0, 5) == [(1, 0, 3), (2, 0, 4)]
    assert plan_lane(units, 0, 0, False, 1, 0, 6) == [(1, 1, 3), (2, 0, 4)]
    assert plan_lane(units, 0, 0, False, 1, 0, 11) == [(2, 3, 4)]
    # 12 samples in 3 lanes of 4: each lane reads only the row groups its part of the order lies in
    assert [plan_lane(units, 0, 0, False, 3, lane) for lane in range(3)] == [
        [(0, 0, 4)],
        [(0, 4, 5), (1, 0, 3)],
        [(2, 0, 4)],
    ]
    assert plan_lane(units, 0, 0, False, 3, 1, 2) == [(1, 1, 3)]
    # 5 lanes of 2: the epoch's last 12 % 5 = 2 samples wait for the next epoch's order
    assert plan_lane(units, 0, 0, False, 5, 4) == [(2, 0, 2)]


# ---------------------------------------------------------------- errors


@pytest.mark.invariant(6, 13)
def test_schema_errors(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(
        pa.table(
            {"sample_id": pa.array([0, 1], pa.int32()), "input_ids": pa.array([[1, 2], [3, 4]], pa.list_(pa.int32()))}
        ),
        bad / "part-00000.parquet",
    )
    with pytest.raises(DataError) as ei:
        scan_units(bad)
    msg = str(ei.value)
    assert "part-00000.parquet" in msg and "sample_id" in msg and "int64" in msg

    bad2 = tmp_path / "bad2"
    bad2.mkdir()
    pq.write_table(
        pa.table(
            {"sample_id": pa.array([0, 1], pa.int64()), "input_ids": pa.array([[1, 2], [3, 4]], pa.list_(pa.int64()))}
        ),
        bad2 / "part-00003.parquet",
    )
    with pytest.raises(DataError) as ei:
        scan_units(bad2)
    assert str(ei.value) == (
        f"{bad2 / 'part-00003.parquet'}: column 'input_ids' has type list<int64>, which does not cast "
        "to int32 without loss; expected int32 or list<int32> or a narrower type (data.columns.input_ids: int32; "
        "set it to the column's type)"
    )

    narrow = tmp_path / "narrow"  # int16 tokens cast to int32 without loss: read, not refused
    narrow.mkdir()
    pq.write_table(
        pa.table(
            {"sample_id": pa.array([0, 1], pa.int64()), "input_ids": pa.array([[1, 2], [3, -4]], pa.list_(pa.int16()))}
        ),
        narrow / "part-00000.parquet",
    )
    assert len(scan_units(narrow)) == 1
    ids = _column_array(pq.read_table(narrow / "part-00000.parquet"), "input_ids", "int32", "narrow")
    assert ids.dtype == np.int32 and ids.tolist() == [[1, 2], [3, -4]]

    bad3 = tmp_path / "bad3"
    bad3.mkdir()
    pq.write_table(pa.table({"sample_id": pa.array([0], pa.int64())}), bad3 / "x.parquet")
    with pytest.raises(DataError, match="input_ids"):
        scan_units(bad3)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="empty"):
        scan_units(empty)


def test_ensure_dataset(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError) as ei:
        ensure_dataset(missing, None, L, V)
    assert "data.path" in str(ei.value) and "synth" in str(ei.value)
    assert isinstance(ei.value, ValueError)

    cfg = types.SimpleNamespace(samples=30, files=2, row_groups_per_file=2, seed=1)
    p = tmp_path / "made"
    ensure_dataset(p, cfg, L, V)
    units = scan_units(p)
    assert len(units) == 4 and dataset_size(units) == 30
    before = [f.stat().st_mtime_ns for f in sorted(p.glob("*.parquet"))]
    ensure_dataset(p, cfg, L, V)  # already there: untouched
    assert [f.stat().st_mtime_ns for f in sorted(p.glob("*.parquet"))] == before
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []


def test_ensure_dataset_concurrent(tmp_path):
    code = (
        "import sys, types; from ray_resume.data import ensure_dataset;"
        "ensure_dataset(sys.argv[1], types.SimpleNamespace(samples=400, files=4, "
        "row_groups_per_file=4, seed=2), 16, 50)"
    )
    p = tmp_path / "race"
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p)], env=env) for _ in range(3)]
    assert all(pr.wait(timeout=60) == 0 for pr in procs)
    assert dataset_size(scan_units(p)) == 400
    assert sorted(x.name for x in tmp_path.iterdir()) == ["race"]


# ---------------------------------------------------------------- lanes


def local(*args, **kwargs):
    from harness import LocalStream  # the stream's own plan and read function, without Ray Data

    return LocalStream(*args, **kwargs)


@pytest.mark.invariant(3)
def test_lanes_give_every_world_size_the_same_batches(ds_path):
    """8 lanes of 100 // 8 = 12 samples per epoch: a batch of 16 takes 2 from each, in lane order,
    whatever the world size (3 ranks at gbs 24 included); an epoch is 96 distinct samples."""
    units = scan_units(ds_path)
    order = ids_of(units, epoch_order(units, 3, 0, True))
    ref = take(local(units, 3, True, 16, 0, 1, 0, lanes=8), 9)
    for s, b in enumerate(ref[:6]):
        assert b["sample_id"].tolist() == [order[lane * 12 + 2 * s + j] for lane in range(8) for j in range(2)]
    epoch0 = np.concatenate([b["sample_id"] for b in ref[:6]])
    assert (
        len(set(epoch0.tolist())) == 96 and len(set(np.concatenate([b["sample_id"] for b in ref[6:]]).tolist())) == 48
    )
    for gbs, worlds in ((16, (2, 4, 8)), (24, (3,))):
        whole = take(local(units, 3, True, gbs, 0, 1, 0, lanes=8), 9)
        for w in worlds:
            per_rank = [take(local(units, 3, True, gbs, r, w, 0, lanes=8), 9) for r in range(w)]
            for s in range(9):
                for key in ("sample_id", "input_ids"):
                    np.testing.assert_array_equal(
                        np.concatenate([per_rank[r][s][key] for r in range(w)]), whole[s][key]
                    )


@pytest.mark.invariant(3)
def test_lanes_resume_exactly_and_on_another_batch_size_take_the_same_samples(ds_path):
    units = scan_units(ds_path)
    full = take(local(units, 5, True, 16, 0, 1, 0, lanes=8), 12)
    resumed = take(local(units, 5, True, 16, 1, 2, 64, lanes=8), 8)  # rank 1 of 2, from sample 64
    assert len(full) == 12 and len(resumed) == 8
    for a, b in zip(full[4:], resumed):
        np.testing.assert_array_equal(a["sample_id"][8:], b["sample_id"])
    # scenario C: 128 samples at 16, then 2 steps of 24 = the next 3 steps of 16, as a multiset
    rescaled = take(local(units, 5, True, 24, 0, 1, 128, lanes=8), 2)
    assert sorted(np.concatenate([b["sample_id"] for b in rescaled]).tolist()) == sorted(
        np.concatenate([b["sample_id"] for b in full[8:11]]).tolist()
    )
    with pytest.raises(DataError, match="not a multiple of the 8 data lanes"):
        local(units, 5, True, 12, 0, 1, 0, lanes=8)
    with pytest.raises(DataError, match="data cursor 36 is not a multiple"):
        local(units, 5, True, 16, 0, 1, 36, lanes=8)


@pytest.mark.invariant(3)
def test_until_read_workers_have_started_the_stream_reads_itself_and_gives_the_same_batches(ds_path):
    """Until processes for Ray Data's read tasks have started (seconds for a new job), the stream does
    the next reads itself, then Ray Data gets the rest of the epoch's, and the next epoch's. Here the
    processes start when the test says: before that, Ray Data is never asked."""
    from harness import LocalStream

    class Starting(LocalStream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.started, self.asked = False, []

        def _read_workers_ready(self):
            return self.started

        def _execute(self, epoch, items):
            assert self.started, "Ray Data was asked before its read workers started"
            self.asked.append((epoch, items[0]["segment"], len(items)))
            yield from super()._execute(epoch, items)

    units = scan_units(ds_path)
    stream = Starting(units, 5, True, 16, 1, 2, 16, read_tasks_above=0)  # rank 1 of 2, from sample 16
    batches = iter(stream)
    got = [next(batches) for _ in range(2)]  # 32 more of the epoch's 100 samples, read here
    stream.started = True
    got += [next(batches) for _ in range(12)]  # into the next epoch
    expected = take(local(units, 5, True, 16, 1, 2, 16), 14)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert stream.position == 16 + 14 * 16
    (first, after, _), *later = stream.asked  # the rest of epoch 0 after the reads here, then whole epochs
    assert (
        first == 0
        and after > 0
        and later
        and [(e, k) for e, k, _ in later] == [(e, 0) for e in range(1, len(later) + 1)]
    ), stream.asked


@pytest.mark.invariant(3)
def test_reads_that_cost_the_rank_little_stay_in_it_and_costly_ones_go_to_ray_data(ds_path, monkeypatch):
    """The stream reads itself while its reads take at most `read_tasks_above` of the rank's time:
    it starts no read worker and never asks Ray Data. Reads that take more (a data.map costing a
    second per read on the stream's clock) go to Ray Data once judged. The batches are the same."""
    import ray_resume.data.stream as stream_module
    from harness import LocalStream

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(stream_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))

    class Counting(LocalStream):
        started = asked = 0

        def _read_workers_ready(self):
            self.started += 1
            return True

        def _execute(self, epoch, items):
            self.asked += len(items)
            yield from super()._execute(epoch, items)

    def costly(rows):
        clock.now += 1.0
        return rows

    units = scan_units(ds_path)
    expected = take(local(units, 5, True, 16, 1, 2, 16), 20)  # 2 epochs and more
    for data_map, step_s, ray_data in ((None, 0.5, False), (costly, 0.01, True)):
        stream = Counting(units, 5, True, 16, 1, 2, 16, data_map=data_map)
        batches = iter(stream)
        for want in expected:
            got = next(batches)
            clock.now += step_s  # the step the batch is for
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        assert (stream.started > 0, stream.asked > 0) == (ray_data, ray_data), (data_map, stream.started, stream.asked)
        assert stream.read_cost.too_high() == ray_data


def test_without_ray_the_stream_reads_in_its_own_process_and_starts_no_ray(ds_path):
    """Outside Ray (a loop of the user's without ray.init()), the stream reads every row itself,
    even when told to hand its reads to Ray Data, and no Ray task auto-starts a local Ray."""
    import subprocess
    import sys

    from conftest import env_for_subprocess

    code = (
        "import ray, sys; from ray_resume.data import SampleStream\n"
        "ids = [b['sample_id'].tolist() for b, _ in zip(SampleStream(sys.argv[1], 5, True, 16, read_tasks_above=0), range(9))]\n"
        "print(ids, ray.is_initialized())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ds_path)],
        capture_output=True,
        text=True,
        env=env_for_subprocess(),
        timeout=120,
    )
    expected = [b["sample_id"].tolist() for b in take(local(ds_path, 5, True, 16), 9)]  # into the second epoch
    assert out.stdout.strip() == f"{expected} False", out.stdout + out.stderr[-2000:]


@pytest.fixture(scope="module")
def many_groups(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "many"
    write_synthetic(p, 2000, 16, 50, seed=3, files=4, row_groups_per_file=8)  # 32 row groups of 62 or 63 rows
    return p


@pytest.mark.parametrize("lanes, low, high", [(4, 1.0, 1.1), (1, 4.0, 4.0)])
def test_four_ranks_read_what_one_does_with_lanes_and_four_times_it_without(many_groups, lanes, low, high):
    """The bytes 4 ranks read for 150 steps of 16 samples (an epoch and a fifth), against what one
    rank reads for them in the order without lanes: with 4 lanes each row group is read by the
    rank its lane goes to (those cut by a lane's end twice); with one lane, by all four."""
    units = scan_units(many_groups)

    def read(world, lanes):
        streams = [local(units, 1, True, 16, r, world, 0, lanes=lanes) for r in range(world)]
        for stream in streams:
            take(stream, 150)
        return sum(stream.bytes_read for stream in streams)

    one = read(1, 1)
    assert one > sum(u.nbytes for u in units) > 0
    assert low <= read(4, lanes) / one <= high


def test_each_ranks_metrics_record_the_data_bytes_it_read(tmp_path):
    from conftest import read_metrics, run_on_harness, tiny_config

    cfg = tiny_config(tmp_path)
    run_on_harness(cfg)
    units = scan_units(cfg["data"]["path"])
    for rank in (0, 1):
        stream = local(units, 7, True, 16, rank, 2, 0, lanes=8)  # data.lanes: 0 -> gcd(16, 8)
        take(stream, 12)
        recorded = [
            r["data_bytes_read"]
            for r in read_metrics(cfg["checkpoint"]["save_path"])
            if r["rank"] == rank and "data_bytes_read" in r
        ]
        assert recorded[-1] == stream.bytes_read > 0


# ---------------------------------------------------------------- packed documents


@pytest.fixture(scope="module")
def docs_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "docs"
    write_synthetic(p, 300, L, V, seed=5, files=2, row_groups_per_file=3, doc_lens=(1, 30))
    return p


@pytest.mark.invariant(3)
def test_documents_are_packed_in_the_sample_order_and_cut_in_windows(docs_path):
    """A row group's windows: its documents in the epoch's order, concatenated, cut in L + 1 tokens;
    the footer alone says how many there are."""
    table = pq.read_table(docs_path)
    sizes = [len(d) for d in table.column("input_ids").to_pylist()]
    assert min(sizes) == 1 and max(sizes) == 30 and len(set(sizes)) > 20
    units = scan_units(docs_path, pack=L + 1)
    assert [u.num_rows for u in units] == [
        sum(len(d) for d in pq.ParquetFile(u.file).read_row_group(u.row_group).column("input_ids").to_pylist())
        // (L + 1)
        for u in units
    ]
    assert [u.first for u in units] == list(np.cumsum([0] + [u.num_rows for u in units[:-1]]))
    stream = local(units, 4, True, 8, 0, 1, 0, lanes=4, pack=L + 1)
    batch = take(stream, 1)[0]
    assert batch["input_ids"].shape == (8, L + 1) and batch["input_ids"].dtype == np.int32
    # the first window of lane 0 is the first L + 1 tokens of its first row group, documents in their order
    ui, start, _ = plan_lane(units, 4, 0, True, 4, 0)[0]
    from ray_resume.data import unit_row_order

    docs = pq.ParquetFile(units[ui].file).read_row_group(units[ui].row_group).column("input_ids").to_pylist()
    order = unit_row_order(len(docs), 4, 0, ui, True)
    tokens = [t for d in order for t in docs[d]]
    assert batch["input_ids"][0].tolist() == tokens[start * (L + 1) : (start + 1) * (L + 1)]
    assert batch["sample_id"][0] == units[ui].first + start


@pytest.mark.invariant(3)
def test_packed_windows_resume_exactly_on_any_world_size_and_batch_size(docs_path):
    units = scan_units(docs_path, pack=L + 1)
    kw = dict(lanes=4, pack=L + 1)
    full = take(local(units, 4, True, 8, 0, 1, 0, **kw), 70)  # past the epoch of 508 windows
    assert sum(len(b["sample_id"]) for b in full) > sum(u.num_rows for u in units)
    for w in (2, 4):
        parts = [take(local(units, 4, True, 8, r, w, 48, **kw), 60) for r in range(w)]
        for s in range(60):
            np.testing.assert_array_equal(
                np.concatenate([parts[r][s]["input_ids"] for r in range(w)]), full[6 + s]["input_ids"]
            )
    rescaled = take(local(units, 4, True, 16, 0, 1, 48, **kw), 5)  # scenario C: the next 10 steps of 8, as a multiset
    assert sorted(map(tuple, np.concatenate([b["input_ids"] for b in rescaled]).tolist())) == sorted(
        map(tuple, np.concatenate([b["input_ids"] for b in full[6:16]]).tolist())
    )


@pytest.mark.invariant(6, 13)
def test_an_empty_document_is_one_line_naming_its_file_and_row(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    pq.write_table(
        pa.table({"input_ids": pa.array([[1, 2, 3] * 10, [], [4] * 40], pa.list_(pa.int32()))}), path / "a.parquet"
    )
    units = scan_units(path, pack=L + 1)
    with pytest.raises(
        DataError, match=r"a.parquet row group 0: row 1 of 'input_ids' is an empty document; remove the empty rows"
    ):
        take(local(units, 0, False, 2, 0, 1, 0, pack=L + 1), 1)


@pytest.mark.invariant(2, 3)
def test_a_packed_run_killed_mid_way_ends_byte_identical(tmp_path):
    from conftest import KILL_AT_6, assert_same_as_reference, per_step, read_metrics, run_on_harness, tiny_config

    def job(where, fault=None):
        cfg = tiny_config(where)
        cfg["data"] = {
            **cfg["data"],
            "path": str(tmp_path / "docs"),
            "pack": True,
            "synthetic": {
                "samples": 400,
                "files": 2,
                "row_groups_per_file": 3,
                "seed": 3,
                "min_doc_len": 2,
                "max_doc_len": 40,
            },
        }
        run_on_harness(cfg, fault)
        return cfg["checkpoint"]["save_path"]

    clean = job(tmp_path / "clean")
    root = job(tmp_path / "faulty", KILL_AT_6)
    assert [r["step"] for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0] in ([0, 4], [0, 0])
    assert_same_as_reference(root, {"root": clean, "steps": per_step(read_metrics(clean))})


# ---------------------------------------------------------------- data.map


def test_data_map_preprocesses_the_rows_in_ray_datas_read_tasks(ray_ctx, ds_path):
    """The stream's rows are the map's, in the same order; it runs in Ray Data's tasks, and here only
    for the reads the stream does itself until the read tasks' processes have started
    (SampleStream._reads). Taken at a training loop's pace until a row mapped elsewhere comes, at
    most a minute.
    Not smaller: it waits, by design, for the first row Ray Data's tasks mapped."""
    import os
    import time

    import plugin_models

    plain = iter(SampleStream(ds_path, 5, True, 16, 0, 1, 0, lanes=8))
    # The tasks' processes cannot import tests/ (a job's modules come with its working_dir): by value.
    ray_ctx.cloudpickle.register_pickle_by_value(plugin_models)
    try:
        mapped = iter(ray_stream(ds_path, 5, True, 16, 0, 1, 0, lanes=8, data_map=plugin_models.shift_tokens))
        deadline, pids = time.monotonic() + 60, set()
        while not pids - {os.getpid()} and time.monotonic() < deadline:
            a, b = next(plain), next(mapped)
            np.testing.assert_array_equal(b["sample_id"], a["sample_id"])
            np.testing.assert_array_equal(b["input_ids"], (a["input_ids"] * 3 + 1) % 50)
            pids |= set(b["pid"].tolist())
            time.sleep(0.2)  # a step
    finally:
        ray_ctx.cloudpickle.unregister_pickle_by_value(plugin_models)
        plain.close()  # their executions end here, not when collected
        mapped.close()
    assert pids - {os.getpid()}, "no row was mapped in Ray Data's tasks"


@pytest.mark.invariant(6, 13)
def test_a_data_map_that_changes_the_row_count_is_refused_on_the_driver_naming_it(tmp_path):
    from conftest import driver_checks, tiny_config

    cfg = tiny_config(tmp_path, data={"map": "plugin_models:drop_a_row"})
    with pytest.raises(
        DataError,
        match=r"data.map drop_a_row returned \{'input_ids': 1\} rows for the 2 rows of .*part-00000.parquet "
        r"row group 0; it must return one row per row it is given",
    ):
        driver_checks(cfg)


@pytest.mark.invariant(2, 3)
def test_a_run_with_a_data_map_killed_mid_way_ends_byte_identical(tmp_path, local_reference):
    from conftest import KILL_AT_6, assert_same_as_reference, per_step, read_metrics, run_on_harness, tiny_config

    def job(where, fault=None):
        cfg = tiny_config(where, data={"map": "plugin_models:shift_tokens", "collate": "plugin_models:tokens_only"})
        cfg["data"]["path"] = local_reference["data"]
        run_on_harness(cfg, fault)
        return cfg["checkpoint"]["save_path"]

    clean = job(tmp_path / "clean")
    root = job(tmp_path / "faulty", KILL_AT_6)
    assert len([r for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0]) == 2
    assert_same_as_reference(root, {"root": clean, "steps": per_step(read_metrics(clean))})
    # the map changed what it trained on
    assert per_step(read_metrics(clean))[1][0]["loss"] != local_reference["steps"][1][0]["loss"]


@pytest.mark.invariant(6, 13)
def test_a_file_of_another_schema_or_a_document_column_of_the_wrong_type_is_one_line_naming_the_file(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name, kind in (("a", pa.int32()), ("b", pa.int16())):
        pq.write_table(
            pa.table({"sample_id": pa.array([0], pa.int64()), "input_ids": pa.array([[1] * (L + 1)], pa.list_(kind))}),
            mixed / f"{name}.parquet",
        )
    with pytest.raises(
        DataError,
        match=r"b.parquet: column 'input_ids' is list<element: int16>, but list<element: int32> in .*a.parquet; "
        r"every file of a dataset has the same schema",
    ):
        scan_units(mixed)
    words = tmp_path / "words"
    words.mkdir()
    pq.write_table(pa.table({"input_ids": pa.array([["a", "b"]], pa.list_(pa.string()))}), words / "a.parquet")
    with pytest.raises(
        DataError,
        match=r"a.parquet: column 'input_ids' has type list<string>, which does not cast to int32 without loss",
    ):
        scan_units(words, pack=L + 1)


@pytest.mark.invariant(13)
def test_an_empty_document_met_by_a_rank_ends_the_job_in_one_line_without_a_retry(tmp_path):
    """Only a read can see it in a file written without statistics (with them the driver refuses it:
    tests/test_data_mistakes.py): the rank says it once, and the group restarted for it returns at once."""
    import harness
    from conftest import read_metrics, tiny_config
    from ray_resume.api import train

    data = tmp_path / "docs"
    data.mkdir()
    docs = [[1, 2, 3] * 40] * 30 + [[]] + [[4] * 50] * 30
    pq.write_table(
        pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))}),
        data / "a.parquet",
        row_group_size=61,
        write_statistics=False,
    )
    cfg = tiny_config(tmp_path)
    cfg["data"] = {"path": str(data), "pack": True}
    local = harness.LocalBackend()
    with pytest.raises(DataError, match="is an empty document"):  # the rank's DataError, of its class to the caller
        train(cfg, backend=local)
    outcome = local.outcome
    assert re.fullmatch(
        r"rank [01]: .*a\.parquet row group 0: row 30 of 'input_ids' is an empty document; "
        r"remove the empty rows \(data\.pack packs documents of at least one token\)",
        outcome.error,
    ), outcome.error
    assert outcome.committed is None
    assert {r["attempt"] for r in read_metrics(cfg["checkpoint"]["save_path"]) if r.get("event") == "start"} == {0}
