"""Deterministic, exactly resumable sample streams read through Ray Data.

Dataset layout
--------------
A dataset is a directory of ``*.parquet`` files with two columns,
``sample_id: int64`` and ``input_ids: list<int32>`` (every row of the same
length ``seq_len + 1``).  ``python -m ray_resume.data synth ...`` writes a small
learnable synthetic one.

Read units and the sample order
-------------------------------
The unit of reading is one parquet *row group*.  :func:`scan_units` lists the
row groups of the ``*.parquet`` files sorted by file name, reading only the
parquet footers; the position of a unit in that list is its ``unit_index``.

The order in which samples are consumed is a **pure function of
(dataset units, seed, epoch, shuffle, lanes)**:

* per epoch ``e`` the units are visited in the order
  ``np.random.default_rng([seed, e]).permutation(n_units)``;
* inside unit ``i`` the rows are visited in the order
  ``np.random.default_rng([seed, e, i]).permutation(num_rows_i)``;
* ``shuffle=False`` makes both orders the identity.

Lanes (``data.lanes`` = C, see docs/data.md) cut each epoch's order in C
contiguous parts of ``L = N // C`` samples (:func:`plan_lane`); the last
``N % C`` samples of an epoch's order are not served in that epoch. Each
lane is an endless sequence, epoch after epoch. A global batch of ``G``
samples (a multiple of C) takes the next ``G / C`` samples of every lane,
lane 0 first, and rank ``r`` of ``W`` keeps the contiguous slots
``[r*G/W, (r+1)*G/W)`` of it. ``lanes=1`` is a plain walk through the
epochs' orders, where every rank needs every row group.

Why: nothing about the order depends on wall-clock, worker count, task
scheduling or on how far a previous run got.  A checkpoint therefore only has
to store the number of samples consumed ``P``: every lane has served
``P / C`` samples, so a stream restarted with ``start_sample=P`` yields
exactly what an uninterrupted stream yields after ``P`` samples, and with
the global batch size unchanged every step sees the same samples whatever
the world size.

Reading through Ray Data
------------------------
A rank reads only the lanes its slots come from: with ``W`` dividing C, no
row group is read by two ranks (but one cut by a lane's end, by both
lanes).  Per epoch, :class:`SampleStream` plans the reads of its lanes
(:func:`plan_lane`: from the start offset, the first row group sliced at
the right row; none lying wholly before it), orders them by where they
start in their lane, and executes them as
``ray.data.from_items(plan).map_batches(read_fn, batch_size=1)``, where
``read_fn`` reads one row group with pyarrow and applies the within-unit
permutation and the slice.  ``preserve_order`` is on, and the stream
checks that every row arrives in plan order (each carries its read's
index).  Ray Data is the only reader (there is no silent pure-pyarrow
fallback); Ray must already be initialised by the caller (inside Ray Train
workers it is).  The read tasks request a fraction of a CPU so they can be
scheduled while training workers hold whole CPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = [
    "DataError",
    "ReadUnit",
    "write_synthetic",
    "ensure_dataset",
    "scan_units",
    "dataset_size",
    "epoch_unit_order",
    "unit_row_order",
    "epoch_order",
    "lane_length",
    "plan_lane",
    "check_lanes",
    "SampleStream",
    "main",
]

SAMPLE_ID = "sample_id"
INPUT_IDS = "input_ids"
DEFAULT_COLUMNS = {INPUT_IDS: "int32"}  # the built-in GPT's batch; data.columns replaces it
DEFAULT_LANES = 8  # data.lanes: 0 takes gcd(global_batch_size, 8): every world size up to 8 that divides it reads once
_SEGMENT_COL = "__segment"  # internal column: which planned read a row comes from (the order is checked)


class DataError(ValueError):
    """Bad / missing dataset or inconsistent data configuration."""


@dataclass(frozen=True)
class ReadUnit:
    """One parquet row group: the unit of reading."""

    file: str
    row_group: int
    num_rows: int
    nbytes: int = 0  # what reading it takes from storage: the compressed column chunks of the read columns
    first: int = 0  # packed data: the id of its first window (the windows of the row groups before it, in file order)


# --------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------

def _synthetic_rows(rng: np.random.Generator, n: int, seq_len: int, vocab: int) -> np.ndarray:
    """Noisy arithmetic sequences mod vocab: learnable, not pure noise."""
    length = seq_len + 1
    start = rng.integers(0, vocab, size=(n, 1))
    step = rng.integers(1, min(8, max(vocab, 2)), size=(n, 1))
    seq = (start + step * np.arange(length)[None, :]) % vocab
    noise = rng.random((n, length)) < 0.05
    seq = np.where(noise, rng.integers(0, vocab, size=(n, length)), seq)
    return seq.astype(np.int32)


def _synthetic_documents(rng: np.random.Generator, n: int, lengths: Tuple[int, int], vocab: int) -> Tuple[np.ndarray, np.ndarray]:
    """`n` noisy arithmetic sequences of lengths in [lo, hi]: (offsets, tokens) of a list column."""
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=n)
    offsets = np.r_[0, np.cumsum(sizes)].astype(np.int32)
    at = np.arange(offsets[-1]) - np.repeat(offsets[:-1], sizes)  # each token's position in its document
    start, step = (np.repeat(rng.integers(lo, hi, size=n), sizes) for lo, hi in ((0, vocab), (1, min(8, max(vocab, 2)))))
    seq = (start + step * at) % vocab
    noise = rng.random(len(seq)) < 0.05
    return offsets, np.where(noise, rng.integers(0, vocab, size=len(seq)), seq).astype(np.int32)


def _schema() -> pa.Schema:
    return pa.schema([(SAMPLE_ID, pa.int64()), (INPUT_IDS, pa.list_(pa.int32()))])


def _write_files(out_dir: Path, samples: int, seq_len: int, vocab: int, seed: int,
                 files: int, row_groups_per_file: int, doc_lens: Optional[Tuple[int, int]] = None) -> None:
    """Write the parquet files into an existing directory, each file atomically; with `doc_lens`
    (min, max), each row is a document of that many tokens instead of `seq_len + 1`."""
    n_groups = files * row_groups_per_file
    sizes = np.full(n_groups, samples // n_groups, dtype=np.int64)
    sizes[: samples % n_groups] += 1
    rng = np.random.default_rng(seed)
    schema = _schema()
    next_id = 0
    g = 0
    for f in range(files):
        final = out_dir / f"part-{f:05d}.parquet"
        tmp = out_dir / f".{final.name}.{uuid.uuid4().hex}.tmp"
        try:
            with pq.ParquetWriter(str(tmp), schema) as writer:
                for _ in range(row_groups_per_file):
                    n = int(sizes[g])
                    g += 1
                    if n == 0:  # fewer samples than row groups: write no empty row group
                        continue
                    ids = np.arange(next_id, next_id + n, dtype=np.int64)
                    next_id += n
                    if doc_lens:
                        offsets, toks = _synthetic_documents(rng, n, doc_lens, vocab)
                    else:
                        toks = _synthetic_rows(rng, n, seq_len, vocab).reshape(-1)
                        offsets = np.arange(0, (n + 1) * (seq_len + 1), seq_len + 1, dtype=np.int32)
                    lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(toks))
                    writer.write_table(pa.Table.from_arrays([pa.array(ids), lists], schema=schema))
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()


def _check_synth_args(samples: int, seq_len: int, vocab: int, files: int, row_groups_per_file: int) -> None:
    if files < 1 or row_groups_per_file < 1:
        raise DataError("files and row_groups_per_file must be >= 1")
    if samples < 1:
        raise DataError(f"samples must be >= 1, got {samples}")
    if seq_len < 1 or vocab < 2:
        raise DataError(f"need seq_len >= 1 and vocab >= 2 (got seq_len={seq_len}, vocab={vocab})")


def _tmp_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _publish(tmp: Path, final: Path) -> bool:
    """Atomically rename tmp dir to final. False (and tmp removed) if final exists."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise


def write_synthetic(out_dir: Union[str, os.PathLike], samples: int, seq_len: int, vocab: int,
                    seed: int, files: int = 4, row_groups_per_file: int = 4,
                    doc_lens: Optional[Tuple[int, int]] = None) -> None:
    """Write a synthetic dataset of ``files`` parquet files × ``row_groups_per_file`` row groups.

    Rows are spread as evenly as possible (``sample_id`` 0..N-1 in file order);
    if ``samples < files * row_groups_per_file`` the surplus row groups are omitted.

    If ``out_dir`` does not exist the whole dataset is written into a temporary
    sibling directory and renamed into place, so a crash never leaves a partial
    dataset under ``out_dir``. If it exists it must hold no ``*.parquet`` yet;
    each file is then written under a temporary name and ``os.replace``-d.
    """
    _check_synth_args(samples, seq_len, vocab, files, row_groups_per_file)
    if doc_lens and not 1 <= doc_lens[0] <= doc_lens[1]:
        raise DataError(f"need 1 <= --min-doc-len <= --max-doc-len, got {doc_lens[0]} and {doc_lens[1]}")
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise DataError(f"{out} exists and is not a directory")
        if any(out.glob("*.parquet")):
            raise DataError(f"{out} already contains *.parquet files; remove them or choose another --out")
        _write_files(out, samples, seq_len, vocab, seed, files, row_groups_per_file, doc_lens)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out)
    tmp.mkdir()
    try:
        _write_files(tmp, samples, seq_len, vocab, seed, files, row_groups_per_file, doc_lens)
        if not _publish(tmp, out):
            raise DataError(f"{out} was created concurrently by another process")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_dataset(path: Union[str, os.PathLike], synthetic: Any, seq_len: int, vocab: int) -> str:
    """Make sure a dataset exists at ``path``; returns ``str(path)``.

    If ``path`` is missing and ``synthetic`` (an object with attributes
    ``samples, files, row_groups_per_file, seed``) is given, a synthetic dataset
    is written into a temporary directory and renamed into place; if another
    process wins that race, ours is discarded. Missing without ``synthetic`` →
    :class:`DataError`.
    """
    if _on_object_storage(str(path)):  # read as it is: scan_units says what is wrong with it
        return str(path)
    p = Path(path)
    if p.exists():
        return str(p)
    if synthetic is None:
        raise DataError(
            f"data.path {str(p)!r} does not exist and no data.synthetic block is configured; "
            f"create it with `python -m ray_resume.data synth --out {p} --samples N "
            f"--seq-len {seq_len} --vocab {vocab} --seed S` or add a synthetic block")
    samples = int(synthetic.samples)
    files = int(getattr(synthetic, "files", 4))
    rgs = int(getattr(synthetic, "row_groups_per_file", 4))
    seed = int(synthetic.seed)
    lo, hi = getattr(synthetic, "min_doc_len", 0), getattr(synthetic, "max_doc_len", 0)
    _check_synth_args(samples, seq_len, vocab, files, rgs)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(p)
    tmp.mkdir()
    try:
        _write_files(tmp, samples, seq_len, vocab, seed, files, rgs, (lo, hi) if hi else None)
        _publish(tmp, p)  # losing the race is fine: the winner's data is used
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(p)


# --------------------------------------------------------------------------
# Units and order (pure functions)
# --------------------------------------------------------------------------

def _check_schema(file: str, schema: pa.Schema, columns: Dict[str, str], ids: bool = True) -> None:
    """`sample_id` int64 (sample exactness is audited by it) and every configured column.

    A column (or each element of a list column: one fixed-length vector per
    row) must cast to the configured dtype without loss: int16 tokens read as
    int32, int64 ones are refused, since a cast could change them.
    """
    names = schema.names
    if ids and SAMPLE_ID not in names:
        raise DataError(f"{file}: missing column {SAMPLE_ID!r} (expected int64)")
    t = schema.field(SAMPLE_ID).type if ids else pa.int64()
    if t != pa.int64():
        raise DataError(f"{file}: column {SAMPLE_ID!r} has type {t}, expected int64")
    for name, dtype in columns.items():
        want = pa.from_numpy_dtype(np.dtype(dtype))
        if name not in names:
            raise DataError(f"{file}: missing column {name!r} (data.columns wants {dtype} or list<{dtype}>)")
        t = schema.field(name).type
        element = t.value_type if pa.types.is_list(t) else t
        try:
            lossless = np.can_cast(np.dtype(element.to_pandas_dtype()), np.dtype(dtype), casting="safe")
        except (NotImplementedError, TypeError):  # not a numeric type
            lossless = False
        if not lossless:
            shown = f"list<{element}>" if pa.types.is_list(t) else t
            raise DataError(f"{file}: column {name!r} has type {shown}, which does not cast to {dtype} without loss; expected "
                            f"{want} or list<{want}> or a narrower type (data.columns.{name}: {dtype}; set it to the column's type)")


def _on_object_storage(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _parquet(file: str, storage=None) -> pq.ParquetFile:
    """A parquet file on local disk, or on object storage (s3://) with `storage`'s settings
    (checkpoint.storage's: the same endpoint and credential chain as the checkpoints)."""
    if not _on_object_storage(file):
        return pq.ParquetFile(file.removeprefix("file://"))
    from .checkpoint.storage import s3_filesystem

    return pq.ParquetFile(s3_filesystem(storage).open_input_file(file.split("://", 1)[1]))


def _parquet_files(path: str, storage=None) -> List[str]:
    """The ``*.parquet`` files directly under `path`, sorted by name: one listing."""
    if not _on_object_storage(path):
        p = Path(path.removeprefix("file://"))
        if not p.is_dir():
            raise DataError(f"dataset path {path!r} is not a directory")
        return [str(f.resolve()) for f in sorted(p.glob("*.parquet"), key=lambda f: f.name)]
    scheme, key = path.split("://", 1)
    if scheme != "s3":
        raise DataError(f"data.path {path!r}: {scheme}:// is not supported; use a local/NFS path or s3://bucket/prefix")
    from .checkpoint.storage import s3_filesystem

    try:
        listed = s3_filesystem(storage).get_file_info(pafs.FileSelector(key.rstrip("/")))
    except FileNotFoundError:
        raise DataError(f"data.path {path!r} does not exist (no object under that prefix); check the bucket and the prefix") from None
    except OSError as e:  # no such bucket, no access
        raise DataError(f"data.path {path!r} cannot be listed ({str(e).splitlines()[0][:200]}); check the bucket, the "
                        "prefix and the credentials (checkpoint.storage, or the AWS_* environment)") from e
    files = [i for i in listed if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")]
    return [f"{scheme}://{i.path}" for i in sorted(files, key=lambda i: i.base_name)]


def scan_units(path: Union[str, os.PathLike], columns: Optional[Dict[str, str]] = None, storage=None,
               pack: int = 0) -> List[ReadUnit]:
    """One :class:`ReadUnit` per (non-empty) row group, files sorted by name; one listing and the
    footers only. `storage`: object storage settings (checkpoint.storage) for an s3:// path.
    `pack`: rows are documents packed in windows of that many tokens; a unit's samples are then
    its windows, ``tokens // pack`` (the footer counts the tokens)."""
    units: List[ReadUnit] = []
    files = _parquet_files(str(path), storage)
    if not files:
        raise DataError(f"dataset {str(path)!r} holds no *.parquet files; check data.path")
    read = {INPUT_IDS} if pack else {SAMPLE_ID, *(columns or DEFAULT_COLUMNS)}
    first: Optional[Tuple[str, Dict[str, pa.DataType]]] = None  # the first file and its read columns' types
    before = 0  # the samples of the row groups listed so far: the next one's `first`
    for fs in files:
        try:
            pf = _parquet(fs, storage)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{fs}: cannot read parquet footer: {e}") from e
        _check_schema(fs, pf.schema_arrow, columns or DEFAULT_COLUMNS, ids=not pack)
        types = {name: pf.schema_arrow.field(name).type for name in sorted(read)}
        first = first or (fs, types)
        if types != first[1]:
            differ = next(name for name in types if types[name] != first[1][name])
            raise DataError(f"{fs}: column {differ!r} is {types[differ]}, but {first[1][differ]} in {first[0]}; "
                            "every file of a dataset has the same schema")
        md = pf.metadata
        for rg in range(md.num_row_groups):
            group = md.row_group(rg)
            chunks = [group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema.split(".")[0] in read]
            samples = group.num_rows
            if pack:
                samples = sum(c.num_values for c in chunks if c.path_in_schema.startswith(INPUT_IDS + ".")) // pack
            if samples > 0:
                units.append(ReadUnit(fs, rg, int(samples), sum(c.total_compressed_size for c in chunks), before))
                before += int(samples)
    if not units:
        raise DataError(f"dataset {str(path)!r} is empty (no non-empty row groups in *.parquet files)")
    return units


def dataset_size(units: Sequence[ReadUnit]) -> int:
    return int(sum(u.num_rows for u in units))


def epoch_unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order in which unit indices are visited in ``epoch``."""
    if not shuffle:
        return np.arange(n_units, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n_units).astype(np.int64)


def unit_row_order(num_rows: int, seed: int, epoch: int, unit_index: int, shuffle: bool) -> np.ndarray:
    """Order in which the rows of unit ``unit_index`` are visited in ``epoch``."""
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    return np.random.default_rng([seed, epoch, unit_index]).permutation(num_rows).astype(np.int64)


def epoch_order(units: Sequence[ReadUnit], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The full order of ``epoch`` as an ``int64[N, 2]`` array of (unit_index, row)."""
    parts = []
    for ui in epoch_unit_order(len(units), seed, epoch, shuffle):
        rows = unit_row_order(units[ui].num_rows, seed, epoch, int(ui), shuffle)
        parts.append(np.stack([np.full_like(rows, ui), rows], axis=1))
    return np.concatenate(parts, axis=0)


def lane_length(num_samples: int, lanes: int) -> int:
    """Samples per lane per epoch: the epoch's order cut in `lanes` equal parts (the last
    ``num_samples % lanes`` samples of each epoch's order are not used in that epoch)."""
    return num_samples // lanes


def plan_lane(units: Sequence[ReadUnit], seed: int, epoch: int, shuffle: bool, lanes: int, lane: int,
              start_in_lane: int = 0) -> List[Tuple[int, int, int]]:
    """What `lane` of `lanes` reads in ``epoch`` from its position ``start_in_lane`` on.

    A lane is the contiguous part ``[lane*L, (lane+1)*L)`` of the epoch's order (``L`` =
    `lane_length`). Returns ``[(unit_index, row_start, row_end), ...]`` in that order, the rows
    being positions in the unit's permuted row order: no unit lying wholly outside the lane's
    part, or before the offset, is planned.
    """
    length = lane_length(dataset_size(units), lanes)
    if not 0 <= start_in_lane < length:
        raise ValueError(f"start_in_lane={start_in_lane} outside [0, {length})")
    lo, hi = lane * length + start_in_lane, (lane + 1) * length
    plan: List[Tuple[int, int, int]] = []
    cum = 0
    for ui in epoch_unit_order(len(units), seed, epoch, shuffle):
        rows = units[int(ui)].num_rows
        if cum + rows > lo and cum < hi:
            plan.append((int(ui), max(lo, cum) - cum, min(hi, cum + rows) - cum))
        cum += rows
        if cum >= hi:
            break
    return plan


# --------------------------------------------------------------------------
# Ray Data reading
# --------------------------------------------------------------------------

def _column_array(table: pa.Table, name: str, dtype: str, where: str) -> np.ndarray:
    """A scalar column as [rows], a list column as [rows, width] (every row the same width)."""
    column = table.column(name).combine_chunks()
    if not pa.types.is_list(column.type):
        return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    offsets = np.asarray(column.offsets)
    lens = np.diff(offsets)
    if len(lens) and not np.all(lens == lens[0]):
        raise DataError(f"{where}: rows of {name!r} have different lengths")
    width = int(lens[0]) if len(lens) else 0
    flat = np.asarray(column.values)[offsets[0]: offsets[-1]]
    return flat.astype(dtype, copy=False).reshape(len(lens), width)


def _windows(table: pa.Table, pack: int, order: np.ndarray, where: str) -> np.ndarray:
    """The row group's documents in `order`, concatenated and cut in [windows, pack] tokens (the
    tail shorter than a window is left out)."""
    column = table.column(INPUT_IDS).combine_chunks()
    offsets = np.asarray(column.offsets)
    sizes = np.diff(offsets)[order]
    if (sizes == 0).any():
        raise DataError(f"{where}: row {int(order[np.argmax(sizes == 0)])} of {INPUT_IDS!r} is an empty document; "
                        "remove the empty rows (data.pack packs documents of at least one token)")
    values = np.asarray(column.values)
    starts = offsets[order] - np.r_[0, np.cumsum(sizes)[:-1]]  # position of each token: its document's start + rank in it
    tokens = values[np.repeat(starts, sizes) + np.arange(sizes.sum())]
    n = len(tokens) // pack
    return tokens[: n * pack].reshape(n, pack)


def apply_map(fn, rows: Dict[str, np.ndarray], where: str) -> Dict[str, np.ndarray]:
    """`data.map` on `rows` (sample_id kept aside): it must give back one row per row, as numpy arrays."""
    n = len(rows[SAMPLE_ID])
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        out = fn({k: v for k, v in rows.items() if k != SAMPLE_ID})
    except DataError:
        raise
    except Exception as exc:  # the user's function failed on these rows
        raise DataError(f"data.map {name} failed on {where}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, dict) or not out:
        raise DataError(f"data.map {name} returned {type(out).__name__} for {where}; it must return a dict of numpy arrays")
    counts = {k: len(v) if isinstance(v, np.ndarray) and v.ndim else None for k, v in out.items()}
    if any(c != n for c in counts.values()):
        raise DataError(f"data.map {name} returned {counts} rows for the {n} rows of {where}; it must return one row per "
                        "row it is given, as numpy arrays (filtering or splitting rows would change the sample order)")
    return {SAMPLE_ID: rows[SAMPLE_ID], **out}


def _read_unit_batch(batch: Dict[str, np.ndarray], *, seed: int, epoch: int, shuffle: bool,
                     columns: Dict[str, str], storage=None, pack: int = 0, data_map=None) -> Dict[str, np.ndarray]:
    """map_batches UDF: read the row groups described by ``batch`` (one per row, batch_size=1),
    keep the positions ``[row_start, row_end)`` of each one's permuted row order, tagged with
    the item's ``segment`` so the stream can check the order it gets them in. With `pack`, the
    documents are permuted and packed (`_windows`), and the positions are windows."""
    outs: List[Dict[str, np.ndarray]] = []
    for i in range(len(batch["unit_index"])):
        file = str(batch["file"][i])
        rg = int(batch["row_group"][i])
        ui = int(batch["unit_index"][i])
        num_rows = int(batch["num_rows"][i])
        table = _parquet(file, storage).read_row_group(rg, columns=[INPUT_IDS] if pack else [SAMPLE_ID, *columns])
        where = f"{file} row group {rg}"
        rows = slice(int(batch["row_start"][i]), int(batch["row_end"][i]))
        if pack:
            windows = _windows(table, pack, unit_row_order(table.num_rows, seed, epoch, ui, shuffle), where)
            if len(windows) != num_rows:
                raise DataError(f"{where}: packs into {len(windows)} windows, the footer scan said {num_rows}")
            first = int(batch["first"][i])
            out = {SAMPLE_ID: np.arange(first, first + num_rows, dtype=np.int64)[rows], INPUT_IDS: windows[rows].astype(columns[INPUT_IDS])}
        else:
            if table.num_rows != num_rows:
                raise DataError(f"{where}: has {table.num_rows} rows, footer scan said {num_rows}")
            idx = unit_row_order(num_rows, seed, epoch, ui, shuffle)[rows]
            arrays = {SAMPLE_ID: table.column(SAMPLE_ID).to_numpy()}
            arrays.update({name: _column_array(table, name, dtype, where) for name, dtype in columns.items()})
            out = {name: a[idx] for name, a in arrays.items()}
        if data_map is not None:
            out = apply_map(data_map, out, where)
        out[_SEGMENT_COL] = np.full(len(out[SAMPLE_ID]), int(batch["segment"][i]), dtype=np.int64)
        outs.append(out)
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def _items(units: Sequence[ReadUnit], plan: Sequence[Tuple[int, int, int]]) -> List[Dict[str, Any]]:
    """`plan`'s (unit_index, row_start, row_end) as the read function's input rows, `segment` = the position in it."""
    return [{"file": units[ui].file, "row_group": units[ui].row_group, "unit_index": ui, "row_start": rs, "row_end": re,
             "num_rows": units[ui].num_rows, "first": units[ui].first, "segment": k} for k, (ui, rs, re) in enumerate(plan)]


def check_eval_set(path: str, columns: Optional[Dict[str, str]], least: int, storage=None, pack: int = 0) -> None:
    """data.eval_path must be a dataset with the training columns and at least `least` samples
    (every rank evaluates the same number of micro-batches)."""
    units = scan_units(path, columns, storage, pack)
    if dataset_size(units) < least:
        raise DataError(f"data.eval_path {path!r} holds {dataset_size(units)} samples; evaluating needs at least "
                        f"{least} (scaling.num_workers x training.micro_batch_size)")


def _read_now(units: Sequence[ReadUnit], plan, **read_args) -> Dict[str, np.ndarray]:
    """The rows of `plan` read in this process, in file order, without their read's index."""
    items = _items(units, plan)
    block = _read_unit_batch({k: np.array([item[k] for item in items]) for k in items[0]}, seed=0, epoch=0, shuffle=False, **read_args)
    return {k: v for k, v in block.items() if k != _SEGMENT_COL}


def read_eval_set(path: str, columns: Dict[str, str], storage=None, pack: int = 0, data_map=None) -> Dict[str, np.ndarray]:
    """The held-out dataset whole, in file order (no shuffle): every evaluation sees the same samples."""
    units = scan_units(path, columns, storage, pack)
    return _read_now(units, [(i, 0, u.num_rows) for i, u in enumerate(units)], columns=columns, storage=storage, pack=pack,
                     data_map=data_map)


def check_data_map(units: Sequence[ReadUnit], data_map, columns: Dict[str, str], storage=None, pack: int = 0) -> None:
    """data.map tried on the driver on the first two samples: a function that fails, or does not
    give back one row per row, is found before Ray starts (raises DataError)."""
    _read_now(units, [(0, 0, min(2, units[0].num_rows))], columns=columns, storage=storage, pack=pack, data_map=data_map)


def data_error_in(exc: BaseException) -> Optional[DataError]:
    """The DataError a Ray Data read task raised, from inside the exceptions Ray wraps it in."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DataError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None


def quiet_ray_data() -> None:
    """No Ray Data banners, plans or progress bars on this process's console (they stay in Ray
    Data's log files): each epoch's stream on each rank printed a dozen lines, most of them blank
    progress-bar refreshes. `python -m ray_resume.run --verbose` keeps them."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "Progress bars disabled", once per process


def data_fingerprint(units: Sequence[ReadUnit], seed: int, shuffle: bool, columns: Dict[str, str], lanes: int = 1,
                     pack: int = 0) -> Dict[str, Any]:
    """What the sample order and the batches depend on, for common.json: a resume that differs
    in any of it would continue with another order (see `fingerprint_changes`).

    The dataset is named by its row groups (file names, not paths, and row
    counts): a copy of it moved elsewhere is the same dataset.
    """
    groups = [[Path(u.file).name, u.row_group, u.num_rows] for u in units]
    return {"seed": int(seed), "shuffle": bool(shuffle), "columns": dict(sorted(columns.items())), "lanes": int(lanes), "pack": int(pack),
            "samples": dataset_size(units), "row_groups": len(units),
            "row_groups_sha256": hashlib.sha256(json.dumps(groups).encode()).hexdigest()}


def fingerprint_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """What differs between two `data_fingerprint`s, in config terms (e.g. "data.seed 7 -> 8")."""
    saved = {"lanes": 1, "pack": 0, **saved}  # written before there were lanes or packing
    changes = [f"data.{key} {json.dumps(saved.get(key))} -> {json.dumps(now[key])}"
               for key in ("seed", "shuffle", "columns", "lanes", "pack") if saved.get(key) != now[key]]
    if any(saved.get(key) != now[key] for key in ("samples", "row_groups", "row_groups_sha256")):
        changes.append(f"the dataset at data.path: {saved.get('samples')} samples in {saved.get('row_groups')} row groups -> "
                       f"{now['samples']} in {now['row_groups']}" + (" (other files or row groups)" if saved.get("samples") == now["samples"] else ""))
    return changes


class SampleStream:
    """Infinite stream of this rank's slice of each global batch.

    ``SampleStream(source, seed, shuffle, global_batch_size, rank=0,
    world_size=1, start_sample=0, columns=None, lanes=1, storage=None, pack=0,
    data_map=None)`` where ``source`` is a dataset
    path or a list of :class:`ReadUnit`. Iterating yields, per global step,
    ``{"sample_id": int64[b], column: array[b, ...] for each column}`` with
    ``b = global_batch_size // world_size`` (default column: ``input_ids``
    int32 [b, L+1]). :attr:`position` is the global
    position (samples consumed) after the last yielded step -- store it in a
    checkpoint and pass it back as ``start_sample`` to resume exactly.
    :attr:`bytes_read` is what this rank has read from storage so far.

    ``lanes`` (a divisor of every global batch size the run uses) cuts each epoch's order in
    that many parts; a global batch takes ``global_batch_size // lanes`` samples from each, in
    lane order, and a rank reads only the lanes its slice takes from: with the world size
    dividing ``lanes``, every sample is read by one rank (see docs/data.md).
    ``storage``: object storage settings for an ``s3://`` dataset (checkpoint.storage's keys);
    ``pack``: rows are documents, packed in windows of that many tokens; ``data_map``: a
    row-preserving function Ray Data's read tasks apply to the rows they read.
    """

    def __init__(self, source: Union[str, os.PathLike, Sequence[ReadUnit]], seed: int, shuffle: bool,
                 global_batch_size: int, rank: int = 0, world_size: int = 1, start_sample: int = 0,
                 columns: Optional[Dict[str, str]] = None, lanes: int = 1, storage=None, pack: int = 0, data_map=None,
                 *, prefetch_batches: int = 2, read_num_cpus: float = 0.25):
        self.columns = dict(columns or DEFAULT_COLUMNS)
        self.data_map = data_map  # rows -> the same rows, in the read tasks (data.map)
        self.pack = int(pack)  # rows are documents, packed in windows of this many tokens (0: rows are samples)
        if self.pack and set(self.columns) != {INPUT_IDS}:
            raise DataError(f"packed documents have one column, {INPUT_IDS!r}; got columns {sorted(self.columns)}")
        # Object storage settings (checkpoint.storage's keys) for s3:// files; the read tasks get
        # them as arguments, in memory. None: the AWS credential chain of each reading process.
        self.storage = storage.model_dump() if hasattr(storage, "model_dump") else storage
        if isinstance(source, (str, os.PathLike)):
            self.units: List[ReadUnit] = scan_units(source, self.columns, self.storage, self.pack)
        else:
            self.units = list(source)
            if not self.units:
                raise DataError("empty list of read units")
        if global_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch/rank config: gbs={global_batch_size} rank={rank} world_size={world_size}")
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size {global_batch_size} not divisible by world_size {world_size}")
        if start_sample < 0:
            raise ValueError(f"start_sample must be >= 0, got {start_sample}")
        self.num_samples = dataset_size(self.units)
        check_lanes(lanes, global_batch_size, self.num_samples, start_sample)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.global_batch_size = int(global_batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.local_batch_size = self.global_batch_size // self.world_size
        self.start_sample = int(start_sample)
        self.position = self.start_sample
        self.lanes = int(lanes)
        self.epoch_size = self.lanes * lane_length(self.num_samples, self.lanes)  # samples an epoch's order serves
        self.bytes_read = 0
        self.fingerprint = data_fingerprint(self.units, self.seed, self.shuffle, self.columns, self.lanes, self.pack)
        self.prefetch_batches = int(prefetch_batches)
        self.read_num_cpus = float(read_num_cpus)

    def read_args(self, epoch: int) -> Dict[str, Any]:
        """The read function's keyword arguments for `epoch`."""
        return {"seed": self.seed, "epoch": epoch, "shuffle": self.shuffle, "columns": self.columns, "storage": self.storage,
                "pack": self.pack, "data_map": self.data_map}

    def _execute(self, epoch: int, items: List[Dict[str, Any]]) -> Iterator[Dict[str, np.ndarray]]:
        """The planned reads of `epoch`, in order, through Ray Data (the harness runs them in-process)."""
        import ray
        import ray.data

        if not ray.is_initialized():
            raise RuntimeError("SampleStream needs Ray to be initialised by the caller (ray.init())")
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            _read_unit_batch, batch_size=1, batch_format="numpy",
            fn_kwargs=self.read_args(epoch),
            num_cpus=self.read_num_cpus,
        )
        yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=self.prefetch_batches)

    def _read_checked(self, epoch: int, items: List[Dict[str, Any]]) -> Iterator[Dict[str, np.ndarray]]:
        """`_execute`, a DataError of the read function raised as itself (one line, the user's to fix)."""
        try:
            yield from self._execute(epoch, items)
        except Exception as exc:
            found = data_error_in(exc)
            if found is None or found is exc:
                raise
            raise DataError(str(found)) from None

    def _pieces(self, lanes: Sequence[int]) -> Iterator[Tuple[int, Dict[str, np.ndarray]]]:
        """(lane, rows) for `lanes`, from the start offset on, forever; each epoch's reads ordered
        by where in its lane they start, so the lane that needs rows next has them first."""
        length = lane_length(self.num_samples, self.lanes)
        epoch, start = divmod(self.start_sample // self.lanes, length)
        while True:
            plan = []
            for lane in lanes:
                at = start
                for ui, rs, re in plan_lane(self.units, self.seed, epoch, self.shuffle, self.lanes, lane, start):
                    plan.append((at, lane, (ui, rs, re)))
                    at += re - rs
            plan.sort(key=lambda p: p[:2])
            k, left = 0, None  # the read being received, and its rows still to come
            for batch in self._read_checked(epoch, _items(self.units, [p[2] for p in plan])):
                segments = batch[_SEGMENT_COL]
                cuts = np.flatnonzero(np.diff(segments)) + 1
                for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(segments)]):
                    if left == 0:
                        k, left = k + 1, None
                    if left is None and k < len(plan):
                        ui, rs, re = plan[k][2]
                        left = re - rs
                        self.bytes_read += self.units[ui].nbytes
                    if k >= len(plan) or int(segments[lo]) != k or hi - lo > left:
                        raise DataError(f"epoch {epoch}: Ray Data delivered rows out of plan order")
                    left -= hi - lo
                    yield plan[k][1], {name: v[lo:hi] for name, v in batch.items() if name != _SEGMENT_COL}
            if k + (left == 0) != len(plan):
                raise DataError(f"epoch {epoch}: fewer rows than planned ({k + (left == 0)}/{len(plan)} reads complete)")
            epoch, start = epoch + 1, 0

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        per_lane = self.global_batch_size // self.lanes
        lo = self.rank * self.local_batch_size
        hi = lo + self.local_batch_size
        lanes = range(lo // per_lane, (hi - 1) // per_lane + 1)  # this rank's slice takes from these
        pending: Dict[int, List[Dict[str, np.ndarray]]] = {lane: [] for lane in lanes}
        have = dict.fromkeys(lanes, 0)
        pieces = self._pieces(list(lanes))
        self.position = self.start_sample
        while True:
            parts = []
            for lane in lanes:
                while have[lane] < per_lane:
                    got, rows = next(pieces)
                    pending[got].append(rows)
                    have[got] += len(rows[SAMPLE_ID])
                joined = {k: np.concatenate([b[k] for b in pending[lane]]) for k in pending[lane][0]}
                pending[lane] = [{k: v[per_lane:] for k, v in joined.items()}]
                have[lane] -= per_lane
                first = lane * per_lane  # this lane's first slot in the global batch
                parts.append({k: v[max(lo, first) - first: min(hi, first + per_lane) - first] for k, v in joined.items()})
            self.position += self.global_batch_size
            yield {k: np.ascontiguousarray(np.concatenate([p[k] for p in parts])) for k in parts[0]}


def check_lanes(lanes: int, global_batch_size: int, num_samples: int, start_sample: int = 0) -> None:
    """`lanes` fits the batch size, the dataset and the cursor (a multiple of it: every batch size was)."""
    if lanes < 1 or global_batch_size % lanes:
        raise DataError(f"global_batch_size {global_batch_size} is not a multiple of the {lanes} data lanes "
                        "(data.lanes): every global batch takes the same number of samples from each lane")
    if num_samples < lanes:
        raise DataError(f"the dataset holds {num_samples} samples, fewer than its {lanes} data lanes (data.lanes)")
    if start_sample % lanes:
        raise DataError(f"the data cursor {start_sample} is not a multiple of the {lanes} data lanes (data.lanes): "
                        "it was saved with other lanes")


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_resume.data")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="write a synthetic parquet dataset")
    s.add_argument("--out", required=True)
    s.add_argument("--samples", type=int, required=True)
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--vocab", type=int, required=True)
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--files", type=int, default=4)
    s.add_argument("--row-groups-per-file", type=int, default=4)
    s.add_argument("--min-doc-len", type=int, default=0, help="with --max-doc-len: documents of these many tokens (data.pack)")
    s.add_argument("--max-doc-len", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "synth":
        docs = (args.min_doc_len, args.max_doc_len) if args.max_doc_len else None
        try:
            write_synthetic(args.out, args.samples, args.seq_len, args.vocab, args.seed,
                            files=args.files, row_groups_per_file=args.row_groups_per_file, doc_lens=docs)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        what = f"documents of {docs[0]} to {docs[1]} tokens (" if docs else f"samples (seq_len={args.seq_len}, "
        print(f"wrote {args.samples} {what}vocab={args.vocab}, seed={args.seed}) "
              f"to {args.out}: {args.files} files x {args.row_groups_per_file} row groups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
