"""Reading through Ray Data: each rank's stream of its slice of every global batch, the read
function Ray Data's tasks run, data.map, and the held-out set."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import DataError
from .files import (DEFAULT_COLUMNS, INPUT_IDS, SAMPLE_ID, ReadUnit, _column_array, _parquet, _windows, check_token_ids, dataset_size,
                    scan_units)
from .order import check_lanes, data_fingerprint, lane_length, plan_lane, unit_row_order

_SEGMENT_COL = "__segment"  # internal column: which planned read a row comes from (the order is checked)


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
                     columns: Dict[str, str], storage=None, pack: int = 0, data_map=None,
                     vocab_size: Optional[int] = None) -> Dict[str, np.ndarray]:
    """map_batches UDF: read the row groups described by ``batch`` (one per row, batch_size=1),
    keep the positions ``[row_start, row_end)`` of each one's permuted row order, tagged with
    the item's ``segment`` so the stream can check the order it gets them in. With `pack`, the
    documents are permuted and packed (`_windows`), and the positions are windows. `vocab_size`: the
    token ids read are checked below it (what the driver saw only where the footers keep statistics)."""
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
        if vocab_size is not None:
            check_token_ids(out[INPUT_IDS], vocab_size, where)
        if data_map is not None:
            out = apply_map(data_map, out, where)
        out[_SEGMENT_COL] = np.full(len(out[SAMPLE_ID]), int(batch["segment"][i]), dtype=np.int64)
        outs.append(out)
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def _start_read_worker() -> None:
    """A Ray task: it leaves its worker process with what Ray Data's read tasks import (this module
    comes with the function)."""
    import ray.data  # noqa: F401


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
    # ERROR, not WARNING: Ray Data warns "Progress bars disabled" once per process, from a module of its
    # own internals whose logger name is not a public one to quiet alone
    logging.getLogger("ray.data").setLevel(logging.ERROR)


class ReadCost:
    """The share of a rank's time its own reads take, from the end of its first read (which pays for
    imports and the first open) on, judged once a second has passed (a step's reads come back to
    back); `too_high()` once it passes `above` (0: from the start) and ever after."""

    JUDGED_AFTER_S = 1.0

    def __init__(self, above: float):
        self.above = float(above)
        self.since: Optional[float] = None
        self.seconds = 0.0  # spent reading since then
        self.high = self.above <= 0

    def add(self, seconds: float) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
            return
        self.seconds += seconds
        elapsed = now - self.since
        self.high = self.high or (elapsed >= self.JUDGED_AFTER_S and self.seconds > self.above * elapsed)

    def too_high(self) -> bool:
        return self.high


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
    ``read_tasks_above``: the rank reads itself while its reads take less than this share of its
    time, and Ray Data's read tasks take over once they take more (0: as soon as they can start).
    """

    def __init__(self, source: Union[str, os.PathLike, Sequence[ReadUnit]], seed: int, shuffle: bool,
                 global_batch_size: int, rank: int = 0, world_size: int = 1, start_sample: int = 0,
                 columns: Optional[Dict[str, str]] = None, lanes: int = 1, storage=None, pack: int = 0, data_map=None,
                 vocab_size: Optional[int] = None, *, prefetch_batches: int = 2, read_num_cpus: float = 0.25,
                 read_tasks_above: float = 0.02):
        self.columns = dict(columns or DEFAULT_COLUMNS)
        self.data_map = data_map  # rows -> the same rows, in the read tasks (data.map)
        self.vocab_size = vocab_size  # input_ids are token ids below it (the built-in model's), checked as read
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
        self._starting = None  # the tasks starting processes for the read tasks (_read_workers_ready)
        self.read_cost = ReadCost(read_tasks_above)

    def read_args(self, epoch: int) -> Dict[str, Any]:
        """The read function's keyword arguments for `epoch`."""
        return {"seed": self.seed, "epoch": epoch, "shuffle": self.shuffle, "columns": self.columns, "storage": self.storage,
                "pack": self.pack, "data_map": self.data_map, "vocab_size": self.vocab_size}

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
            # As many reads at once as the stream holds ahead: Ray Data would otherwise start a read
            # task, each a new worker process at the first epoch, on every free CPU slot (8 at 0.25
            # CPU on 2 free CPUs), and their start-up delayed the first step 9 s instead of 4 here.
            num_cpus=self.read_num_cpus, compute=ray.data.TaskPoolStrategy(size=max(1, self.prefetch_batches)),
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

    def _read_workers_ready(self) -> bool:
        """Whether processes for Ray Data's read tasks have started; the first call starts them, as
        many as the stream reads at once, each with what a read task imports. Ray Data's tasks then
        run in them (the same job and runtime environment), not in processes of their own to wait for."""
        import ray

        if not ray.is_initialized():  # a loop outside Ray: its process reads (a task would start a Ray of its own)
            return False
        if self._starting is None:
            start = ray.remote(num_cpus=self.read_num_cpus)(_start_read_worker)
            self._starting = [start.remote() for _ in range(max(1, self.prefetch_batches))]
        if self._starting:
            _, self._starting = ray.wait(self._starting, num_returns=len(self._starting), timeout=0)
        return not self._starting

    def _reads(self, epoch: int, items: List[Dict[str, Any]]) -> Iterator[Dict[str, np.ndarray]]:
        """`_read_checked` once reading here costs the rank more than `read_tasks_above` of its time
        and processes for the read tasks have started (4-5 s for a new job's first here); until then
        the next reads are done in this process by the same function, and Ray Data gets the rest.
        Cheap reads never start a process: on 2 cores four read workers starting beside two ranks
        slowed the quickstart's first 30 steps 2-7x, for reads of 1 ms per 8 steps."""
        given = 0
        while given < len(items) and not (self.read_cost.too_high() and self._read_workers_ready()):
            began = time.monotonic()
            rows = _read_unit_batch({k: np.array([v]) for k, v in items[given].items()}, **self.read_args(epoch))
            self.read_cost.add(time.monotonic() - began)
            yield rows
            given += 1
        if given < len(items):
            yield from self._read_checked(epoch, items[given:])  # each keeps its index in the plan

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
            for batch in self._reads(epoch, _items(self.units, [p[2] for p in plan])):
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
