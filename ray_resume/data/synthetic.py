"""Small learnable synthetic datasets (noisy arithmetic sequences), written atomically:
`python -m ray_resume.data synth ...`, or `data.synthetic` in a config."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError
from ..checkpoint.format.paths import on_object_storage
from .files import INPUT_IDS, SAMPLE_ID

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
    if on_object_storage(str(path)):  # read as it is: scan_units says what is wrong with it
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
