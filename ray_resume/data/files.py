"""The dataset on disk or object storage: its parquet files, their row groups (the unit of
reading), their schema, and a row group's columns as arrays."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..checkpoint.format.paths import local_path, on_object_storage
from ..errors import DataError

SAMPLE_ID = "sample_id"
INPUT_IDS = "input_ids"
DEFAULT_COLUMNS = {INPUT_IDS: "int32"}  # the built-in GPT's batch; data.columns replaces it
DEFAULT_LANES = 8  # data.lanes: 0 takes gcd(global_batch_size, 8): every world size up to 8 that divides it reads once



@dataclass(frozen=True)
class ReadUnit:
    """One parquet row group: the unit of reading."""

    file: str
    row_group: int
    num_rows: int
    nbytes: int = 0  # what reading it takes from storage: the compressed column chunks of the read columns
    first: int = 0  # packed data: the id of its first window (the windows of the row groups before it, in file order)


@dataclass(frozen=True)
class Tokens:
    """What the built-in batch takes from `input_ids`: windows of `window` tokens (model.seq_len + 1:
    the inputs and the shifted targets), or documents packed in them (`packed`); ids below
    `vocab_size` (None: the model is the user's, its vocabulary unknown here)."""

    window: int
    packed: bool
    vocab_size: Optional[int] = None


def _check_tokens(where: str, group, rows: int, tokens: Tokens) -> None:
    """One row group's `input_ids` against `tokens`, from its footer alone: the number of token values
    (always there) and, where the writer kept statistics, the smallest and largest id and the nulls."""
    [chunk] = [group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema.split(".")[0] == INPUT_IDS]
    listed = chunk.path_in_schema != INPUT_IDS
    if not listed:
        raise DataError(f"{where}: column {INPUT_IDS!r} holds one token per row; the built-in batch takes a list of "
                        f"tokens per row (windows of model.seq_len + 1 = {tokens.window}, or documents with data.pack: true)")
    values = chunk.num_values  # every token of the row group (an empty or null list counts one)
    if not tokens.packed and values != rows * tokens.window:
        if values % rows == 0:
            raise DataError(f"{where}: rows of {INPUT_IDS!r} hold {values // rows} tokens, but the model takes windows of "
                            f"model.seq_len + 1 = {tokens.window}; set model.seq_len: {values // rows - 1}")
        raise DataError(f"{where}: {rows} rows of {INPUT_IDS!r} hold {values} tokens, not windows of model.seq_len + 1 = "
                        f"{tokens.window} each: these are documents of different lengths; set data.pack: true to pack "
                        "them in windows")
    stats = chunk.statistics
    if stats is None:
        return
    if stats.has_null_count and stats.null_count:
        what = "empty or missing documents or tokens" if tokens.packed else "missing rows or tokens"
        raise DataError(f"{where}: column {INPUT_IDS!r} holds {stats.null_count} {what} (nulls in the footer's statistics); "
                        "remove those rows, or write them in full: no key can fix it")
    if not stats.has_min_max:
        return
    if stats.min < 0:
        raise DataError(f"{where}: column {INPUT_IDS!r} holds token id {stats.min}; token ids are 0 or more (tokenize again)")
    if tokens.vocab_size is not None and stats.max >= tokens.vocab_size:
        raise DataError(f"{where}: column {INPUT_IDS!r} holds token id {stats.max}, but model.vocab_size is {tokens.vocab_size}; "
                        f"set model.vocab_size: {stats.max + 1} or more (or tokenize with the model's vocabulary)")


def check_token_ids(tokens: np.ndarray, vocab_size: Optional[int], where: str) -> None:
    """What a read task checks of every row group it reads, statistics or none: a min/max pass."""
    if tokens.size and (int(tokens.min()) < 0 or (vocab_size is not None and int(tokens.max()) >= vocab_size)):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise DataError(f"{where}: column {INPUT_IDS!r} holds token id {bad}, outside [0, model.vocab_size = {vocab_size}); "
                        f"{'tokenize again' if bad < 0 else f'set model.vocab_size: {bad + 1} or more'}")


def _check_schema(file: str, schema: pa.Schema, columns: Dict[str, str], ids: bool = True) -> None:
    """`sample_id` int64 (sample exactness is audited by it) and every configured column.

    A column (or each element of a list column: one fixed-length vector per
    row) must cast to the configured dtype without loss: int16 tokens read as
    int32, int64 ones are refused, since a cast could change them.
    """
    names = schema.names
    if ids and SAMPLE_ID not in names:
        raise DataError(f"{file}: missing column {SAMPLE_ID!r} (int64: each sample's id, by which resumes are audited); "
                        "add it, or set data.pack: true if the rows are documents to pack")
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


def _parquet(file: str, storage=None) -> pq.ParquetFile:
    """A parquet file on local disk, or on object storage (s3://) with `storage`'s settings
    (checkpoint.storage's: the same endpoint and credential chain as the checkpoints)."""
    if not on_object_storage(file):
        return pq.ParquetFile(local_path(file))
    from ..checkpoint.io.object_store import s3_filesystem

    return pq.ParquetFile(s3_filesystem(storage).open_input_file(file.split("://", 1)[1]))


def _parquet_files(path: str, storage=None) -> List[str]:
    """The ``*.parquet`` files directly under `path`, sorted by name: one listing."""
    if not on_object_storage(path):
        p = Path(local_path(path))
        if not p.is_dir():
            raise DataError(f"data.path {path!r} is not a directory (of *.parquet files); check data.path")
        return [str(f.resolve()) for f in sorted(p.glob("*.parquet"), key=lambda f: f.name)]
    scheme, key = path.split("://", 1)
    if scheme != "s3":
        raise DataError(f"data.path {path!r}: {scheme}:// is not supported; use a local/NFS path or s3://bucket/prefix")
    from ..checkpoint.io.object_store import s3_filesystem

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
               pack: int = 0, tokens: Optional[Tokens] = None) -> List[ReadUnit]:
    """One :class:`ReadUnit` per (non-empty) row group, files sorted by name; one listing and the
    footers only. `storage`: object storage settings (checkpoint.storage) for an s3:// path.
    `pack`: rows are documents packed in windows of that many tokens; a unit's samples are then
    its windows, ``tokens // pack`` (the footer counts the tokens). `tokens`: check every row
    group's `input_ids` against what the built-in batch takes (`_check_tokens`)."""
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
            if tokens is not None and samples:
                _check_tokens(f"{fs} row group {rg}", group, samples, tokens)
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
    # position of each token: its document's start + rank in it
    starts = offsets[order] - np.r_[0, np.cumsum(sizes)[:-1]]
    tokens = values[np.repeat(starts, sizes) + np.arange(sizes.sum())]
    n = len(tokens) // pack
    return tokens[: n * pack].reshape(n, pack)
