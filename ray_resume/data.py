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
(dataset units, seed, epoch, shuffle)**:

* per epoch ``e`` the units are visited in the order
  ``np.random.default_rng([seed, e]).permutation(n_units)``;
* inside unit ``i`` the rows are visited in the order
  ``np.random.default_rng([seed, e, i]).permutation(num_rows_i)``;
* ``shuffle=False`` makes both orders the identity.

Concatenating the epochs gives an infinite sequence of *global positions*
``p = 0, 1, 2, ...`` (``epoch = p // N`` with ``N`` the dataset size).  Global
step ``k`` of a stream started at ``start_sample`` consumes positions
``[start_sample + k*gbs, start_sample + (k+1)*gbs)``, crossing epoch
boundaries seamlessly, and rank ``r`` of ``W`` keeps the contiguous slice
``[r*gbs/W, (r+1)*gbs/W)`` of that global batch.

Why: nothing about the order depends on wall-clock, worker count, task
scheduling or on how far a previous run got.  A checkpoint therefore only has
to store the number of samples consumed; a stream restarted with
``start_sample=o`` yields exactly what an uninterrupted stream yields after
``o`` samples (``o`` need not be a multiple of the batch size), and with the
global batch size unchanged every step sees the same samples whatever the
world size.

Reading through Ray Data
------------------------
:class:`SampleStream` executes, for each epoch, the plan returned by the pure
function :func:`plan_epoch_units` -- the units of that epoch's order starting
at the unit that holds the start offset, the first one sliced at the right
row; no row group lying wholly before the resume offset is read.  The plan is
turned into ``ray.data.from_items(plan).map_batches(read_fn, batch_size=1)``
where ``read_fn`` reads one row group with pyarrow, applies the within-unit
permutation and the slice.  ``preserve_order`` is switched on and the stream
verifies that blocks arrive in plan order.  Blocks are re-chunked in Python
into exact global batches.  Ray Data is the only reader (there is no silent
pure-pyarrow fallback); Ray must already be initialised by the caller (inside
Ray Train workers it is).  The read tasks request a fraction of a CPU so they
can be scheduled while training workers hold whole CPUs.

Cost note: every rank reads every global batch and keeps only its slice, so
reading costs ``W``× the data.  A rank-aware read (each rank only reading the
row ranges of its slices) is future work.
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
    "plan_epoch_units",
    "SampleStream",
    "main",
]

SAMPLE_ID = "sample_id"
INPUT_IDS = "input_ids"
DEFAULT_COLUMNS = {INPUT_IDS: "int32"}  # the built-in GPT's batch; data.columns replaces it
_UNIT_COL = "__unit_index"  # internal column used to verify block order


class DataError(ValueError):
    """Bad / missing dataset or inconsistent data configuration."""


@dataclass(frozen=True)
class ReadUnit:
    """One parquet row group: the unit of reading."""

    file: str
    row_group: int
    num_rows: int


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


def _schema() -> pa.Schema:
    return pa.schema([(SAMPLE_ID, pa.int64()), (INPUT_IDS, pa.list_(pa.int32()))])


def _write_files(out_dir: Path, samples: int, seq_len: int, vocab: int, seed: int,
                 files: int, row_groups_per_file: int) -> None:
    """Write the parquet files into an existing directory, each file atomically."""
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
                    toks = _synthetic_rows(rng, n, seq_len, vocab)
                    offsets = np.arange(0, (n + 1) * (seq_len + 1), seq_len + 1, dtype=np.int32)
                    lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(toks.reshape(-1)))
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
                    seed: int, files: int = 4, row_groups_per_file: int = 4) -> None:
    """Write a synthetic dataset of ``files`` parquet files × ``row_groups_per_file`` row groups.

    Rows are spread as evenly as possible (``sample_id`` 0..N-1 in file order);
    if ``samples < files * row_groups_per_file`` the surplus row groups are omitted.

    If ``out_dir`` does not exist the whole dataset is written into a temporary
    sibling directory and renamed into place, so a crash never leaves a partial
    dataset under ``out_dir``. If it exists it must hold no ``*.parquet`` yet;
    each file is then written under a temporary name and ``os.replace``-d.
    """
    _check_synth_args(samples, seq_len, vocab, files, row_groups_per_file)
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise DataError(f"{out} exists and is not a directory")
        if any(out.glob("*.parquet")):
            raise DataError(f"{out} already contains *.parquet files; remove them or choose another --out")
        _write_files(out, samples, seq_len, vocab, seed, files, row_groups_per_file)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out)
    tmp.mkdir()
    try:
        _write_files(tmp, samples, seq_len, vocab, seed, files, row_groups_per_file)
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
    _check_synth_args(samples, seq_len, vocab, files, rgs)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(p)
    tmp.mkdir()
    try:
        _write_files(tmp, samples, seq_len, vocab, seed, files, rgs)
        _publish(tmp, p)  # losing the race is fine: the winner's data is used
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(p)


# --------------------------------------------------------------------------
# Units and order (pure functions)
# --------------------------------------------------------------------------

def _check_schema(file: str, schema: pa.Schema, columns: Dict[str, str]) -> None:
    """`sample_id` int64 (sample exactness is audited by it) and every configured column.

    A column (or each element of a list column: one fixed-length vector per
    row) must cast to the configured dtype without loss: int16 tokens read as
    int32, int64 ones are refused, since a cast could change them.
    """
    names = schema.names
    if SAMPLE_ID not in names:
        raise DataError(f"{file}: missing column {SAMPLE_ID!r} (expected int64)")
    t = schema.field(SAMPLE_ID).type
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


def scan_units(path: Union[str, os.PathLike], columns: Optional[Dict[str, str]] = None) -> List[ReadUnit]:
    """One :class:`ReadUnit` per (non-empty) row group, files sorted by name; footers only."""
    p = Path(path)
    if not p.is_dir():
        raise DataError(f"dataset path {str(p)!r} is not a directory")
    files = sorted(p.glob("*.parquet"), key=lambda f: f.name)
    units: List[ReadUnit] = []
    for f in files:
        fs = str(f.resolve())
        try:
            pf = pq.ParquetFile(fs)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{fs}: cannot read parquet footer: {e}") from e
        _check_schema(fs, pf.schema_arrow, columns or DEFAULT_COLUMNS)
        md = pf.metadata
        for rg in range(md.num_row_groups):
            n = md.row_group(rg).num_rows
            if n > 0:
                units.append(ReadUnit(fs, rg, int(n)))
    if not units:
        raise DataError(f"dataset {str(p)!r} is empty (no non-empty row groups in *.parquet files)")
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


def plan_epoch_units(units: Sequence[ReadUnit], seed: int, epoch: int, shuffle: bool,
                     start_in_epoch: int = 0) -> List[Tuple[int, int]]:
    """Units to read for ``epoch`` starting at in-epoch position ``start_in_epoch``.

    Returns ``[(unit_index, row_start), ...]`` in the epoch's unit order; units
    lying wholly before the offset are excluded and the first unit is sliced at
    ``row_start`` (a position in that unit's permuted row order).
    """
    n = dataset_size(units)
    if not 0 <= start_in_epoch < n:
        raise ValueError(f"start_in_epoch={start_in_epoch} outside [0, {n})")
    plan: List[Tuple[int, int]] = []
    cum = 0
    for ui in epoch_unit_order(len(units), seed, epoch, shuffle):
        ui = int(ui)
        rows = units[ui].num_rows
        if cum + rows > start_in_epoch:
            plan.append((ui, max(0, start_in_epoch - cum)))
        cum += rows
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


def _read_unit_batch(batch: Dict[str, np.ndarray], *, seed: int, epoch: int, shuffle: bool,
                     columns: Dict[str, str]) -> Dict[str, np.ndarray]:
    """map_batches UDF: read the one row group described by ``batch`` (batch_size=1)."""
    outs: List[Dict[str, np.ndarray]] = []
    for i in range(len(batch["unit_index"])):
        file = str(batch["file"][i])
        rg = int(batch["row_group"][i])
        ui = int(batch["unit_index"][i])
        row_start = int(batch["row_start"][i])
        num_rows = int(batch["num_rows"][i])
        table = pq.ParquetFile(file).read_row_group(rg, columns=[SAMPLE_ID, *columns])
        where = f"{file} row group {rg}"
        if table.num_rows != num_rows:
            raise DataError(f"{where}: has {table.num_rows} rows, footer scan said {num_rows}")
        idx = unit_row_order(num_rows, seed, epoch, ui, shuffle)[row_start:]
        arrays = {SAMPLE_ID: table.column(SAMPLE_ID).to_numpy()}
        arrays.update({name: _column_array(table, name, dtype, where) for name, dtype in columns.items()})
        out = {name: a[idx] for name, a in arrays.items()}
        out[_UNIT_COL] = np.full(len(idx), ui, dtype=np.int64)
        outs.append(out)
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def check_eval_set(path: str, columns: Optional[Dict[str, str]], least: int) -> None:
    """data.eval_path must be a dataset with the training columns and at least `least` samples
    (every rank evaluates the same number of micro-batches)."""
    units = scan_units(path, columns)
    if dataset_size(units) < least:
        raise DataError(f"data.eval_path {path!r} holds {dataset_size(units)} samples; evaluating needs at least "
                        f"{least} (scaling.num_workers x training.micro_batch_size)")


def read_eval_set(path: str, columns: Dict[str, str]) -> Dict[str, np.ndarray]:
    """The held-out dataset whole, in file order (no shuffle): every evaluation sees the same samples."""
    units = scan_units(path, columns)
    items = {"file": np.array([u.file for u in units]), "row_group": np.array([u.row_group for u in units]),
             "unit_index": np.arange(len(units)), "row_start": np.zeros(len(units), dtype=np.int64),
             "num_rows": np.array([u.num_rows for u in units])}
    block = _read_unit_batch(items, seed=0, epoch=0, shuffle=False, columns=columns)
    return {name: block[name] for name in (SAMPLE_ID, *columns)}


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


def data_fingerprint(units: Sequence[ReadUnit], seed: int, shuffle: bool, columns: Dict[str, str]) -> Dict[str, Any]:
    """What the sample order and the batches depend on, for common.json: a resume that differs
    in any of it would continue with another order (see `fingerprint_changes`).

    The dataset is named by its row groups (file names, not paths, and row
    counts): a copy of it moved elsewhere is the same dataset.
    """
    groups = [[Path(u.file).name, u.row_group, u.num_rows] for u in units]
    return {"seed": int(seed), "shuffle": bool(shuffle), "columns": dict(sorted(columns.items())),
            "samples": dataset_size(units), "row_groups": len(units),
            "row_groups_sha256": hashlib.sha256(json.dumps(groups).encode()).hexdigest()}


def fingerprint_changes(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """What differs between two `data_fingerprint`s, in config terms (e.g. "data.seed 7 -> 8")."""
    changes = [f"data.{key} {json.dumps(saved.get(key))} -> {json.dumps(now[key])}"
               for key in ("seed", "shuffle", "columns") if saved.get(key) != now[key]]
    if any(saved.get(key) != now[key] for key in ("samples", "row_groups", "row_groups_sha256")):
        changes.append(f"the dataset at data.path: {saved.get('samples')} samples in {saved.get('row_groups')} row groups -> "
                       f"{now['samples']} in {now['row_groups']}" + (" (other files or row groups)" if saved.get("samples") == now["samples"] else ""))
    return changes


class SampleStream:
    """Infinite stream of this rank's slice of each global batch.

    ``SampleStream(source, seed, shuffle, global_batch_size, rank=0,
    world_size=1, start_sample=0, columns=None)`` where ``source`` is a dataset
    path or a list of :class:`ReadUnit`. Iterating yields, per global step,
    ``{"sample_id": int64[b], column: array[b, ...] for each column}`` with
    ``b = global_batch_size // world_size`` (default column: ``input_ids``
    int32 [b, L+1]). :attr:`position` is the global
    position (samples consumed) after the last yielded step -- store it in a
    checkpoint and pass it back as ``start_sample`` to resume exactly.
    """

    def __init__(self, source: Union[str, os.PathLike, Sequence[ReadUnit]], seed: int, shuffle: bool,
                 global_batch_size: int, rank: int = 0, world_size: int = 1, start_sample: int = 0,
                 columns: Optional[Dict[str, str]] = None,
                 *, prefetch_batches: int = 2, read_num_cpus: float = 0.25):
        self.columns = dict(columns or DEFAULT_COLUMNS)
        if isinstance(source, (str, os.PathLike)):
            self.units: List[ReadUnit] = scan_units(source, self.columns)
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
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.global_batch_size = int(global_batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.local_batch_size = self.global_batch_size // self.world_size
        self.start_sample = int(start_sample)
        self.position = self.start_sample
        self.num_samples = dataset_size(self.units)
        self.fingerprint = data_fingerprint(self.units, self.seed, self.shuffle, self.columns)
        self.prefetch_batches = int(prefetch_batches)
        self.read_num_cpus = float(read_num_cpus)

    # -- one epoch through Ray Data -------------------------------------
    def _epoch_blocks(self, epoch: int, start_in_epoch: int) -> Iterator[Dict[str, np.ndarray]]:
        import ray
        import ray.data

        if not ray.is_initialized():
            raise RuntimeError("SampleStream needs Ray to be initialised by the caller (ray.init())")
        plan = plan_epoch_units(self.units, self.seed, epoch, self.shuffle, start_in_epoch)
        items = [
            {"file": self.units[ui].file, "row_group": self.units[ui].row_group, "unit_index": ui,
             "row_start": rs, "num_rows": self.units[ui].num_rows}
            for ui, rs in plan
        ]
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            _read_unit_batch, batch_size=1, batch_format="numpy",
            fn_kwargs={"seed": self.seed, "epoch": epoch, "shuffle": self.shuffle, "columns": self.columns},
            num_cpus=self.read_num_cpus,
        )
        # Verify that rows arrive exactly in plan order (guards determinism).
        expected = [(ui, self.units[ui].num_rows - rs) for ui, rs in plan]
        k = 0
        left = expected[0][1]
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy",
                                     prefetch_batches=self.prefetch_batches):
            units_col = batch[_UNIT_COL]
            pos = 0
            while pos < len(units_col):
                if k >= len(expected):
                    raise DataError(f"epoch {epoch}: more rows than planned")
                take = min(left, len(units_col) - pos)
                if not np.all(units_col[pos: pos + take] == expected[k][0]):
                    raise DataError(f"epoch {epoch}: Ray Data delivered rows out of plan order")
                pos += take
                left -= take
                if left == 0:
                    k += 1
                    left = expected[k][1] if k < len(expected) else 0
            yield {name: batch[name] for name in (SAMPLE_ID, *self.columns)}
        if k != len(expected):
            raise DataError(f"epoch {epoch}: fewer rows than planned ({k}/{len(expected)} units complete)")

    def _global_blocks(self) -> Iterator[Dict[str, np.ndarray]]:
        epoch, start_in_epoch = divmod(self.start_sample, self.num_samples)
        while True:
            yield from self._epoch_blocks(epoch, start_in_epoch)
            epoch += 1
            start_in_epoch = 0

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        gbs = self.global_batch_size
        lo = self.rank * self.local_batch_size
        hi = lo + self.local_batch_size
        pending: List[Dict[str, np.ndarray]] = []
        have = 0
        self.position = self.start_sample
        for block in self._global_blocks():
            pending.append(block)
            have += len(block[SAMPLE_ID])
            while have >= gbs:
                joined = {k: np.concatenate([b[k] for b in pending]) if len(pending) > 1 else pending[0][k] for k in block}
                out = {k: np.ascontiguousarray(v[lo:hi]) for k, v in joined.items()}
                pending = [{k: v[gbs:] for k, v in joined.items()}]
                have -= gbs
                self.position += gbs
                yield out


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
    args = parser.parse_args(argv)
    if args.cmd == "synth":
        try:
            write_synthetic(args.out, args.samples, args.seq_len, args.vocab, args.seed,
                            files=args.files, row_groups_per_file=args.row_groups_per_file)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.samples} samples (seq_len={args.seq_len}, vocab={args.vocab}, seed={args.seed}) "
              f"to {args.out}: {args.files} files x {args.row_groups_per_file} row groups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
