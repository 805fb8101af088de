"""Data mistakes found on the driver, before Ray starts: one line naming the file (and row group),
what is wrong and the key to change; exit 2; no traceback; no worker group. Where only a read can
see a mistake (a file written without statistics), the read raises a DataError that ends the run in
one line, never retried. docs/data.md lists what is checked where."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import ray_resume.ray_backend
from conftest import REPO, driver_checks, env_for_subprocess, run_on_harness, tiny_config
from ray_resume import run

WINDOW = 17  # tiny_config: model.seq_len 16, so windows of 17 tokens; vocab_size 64; global batch 16


def write(
    directory: Path,
    rows: list,
    *,
    name: str = "a.parquet",
    ids: bool = True,
    dtype=pa.int32(),
    statistics: bool = True,
    rows_per_group: int = 40,
) -> None:
    """`rows` of `input_ids` (lists of token ids, or scalars), with sample ids 0.. unless not `ids`."""
    directory.mkdir(parents=True, exist_ok=True)
    column = pa.array(rows, pa.list_(dtype) if rows and isinstance(rows[0], list) else dtype)
    table = pa.table({**({"sample_id": pa.array(range(len(rows)), pa.int64())} if ids else {}), "input_ids": column})
    pq.write_table(table, directory / name, row_group_size=rows_per_group, write_statistics=statistics)


def windows(n: int = 64, width: int = WINDOW, top: int = 63) -> list[list[int]]:
    return [[(i * 7 + j) % (top + 1) for j in range(width)] for i in range(n)]


def documents(n: int = 64) -> list[list[int]]:
    return [[(i + j) % 64 for j in range(3 + (i * 11) % 58)] for i in range(n)]


def nested_file(data: Path) -> None:
    (data / "nested.parquet").mkdir(parents=True)


# case: (what it writes under data/, config changes, what the one line says, the key it names)
CASES = {
    "documents without data.pack": (
        lambda d: write(d, documents()),
        {},
        r"a\.parquet row group 0: 40 rows of 'input_ids' hold \d+ tokens, not windows of "
        r"model\.seq_len \+ 1 = 17 each: these are documents of different lengths",
        "data.pack: true",
    ),
    "a token id at or beyond the vocabulary": (
        lambda d: write(d, windows(top=99)),
        {},
        r"a\.parquet row group 0: column 'input_ids' holds token id 99, but model\.vocab_size is 64",
        "model.vocab_size: 100",
    ),
    "windows shorter than seq_len + 1": (
        lambda d: write(d, windows(width=9)),
        {},
        r"a\.parquet row group 0: rows of 'input_ids' hold 9 tokens, but the model takes windows of "
        r"model\.seq_len \+ 1 = 17",
        "model.seq_len: 8",
    ),
    "windows longer than seq_len + 1": (
        lambda d: write(d, windows(width=33)),
        {},
        r"rows of 'input_ids' hold 33 tokens",
        "model.seq_len: 32",
    ),
    "packed documents shorter than one global batch": (
        lambda d: write(d, documents(n=3), ids=False),
        {"data": {"pack": True}},
        r"holds \d+ windows of 17 tokens, fewer than one global batch",
        "training.global_batch_size",
    ),
    "a dataset smaller than one global batch": (
        lambda d: write(d, windows(n=10)),
        {},
        r"holds 10 samples, fewer than one global batch \(training\.global_batch_size: 16\)",
        "training.global_batch_size",
    ),
    "a negative token id": (
        lambda d: write(d, [[-1] + w[1:] for w in windows()]),
        {},
        r"a\.parquet row group 0: column 'input_ids' holds token id -1; token ids are 0 or more",
        "tokenize again",
    ),
    "a missing token": (
        lambda d: write(d, [[None] + w[1:] if i == 3 else w for i, w in enumerate(windows())]),
        {},
        r"a\.parquet row group 0: column 'input_ids' holds 1 missing rows or tokens",
        "remove those rows",
    ),
    "an empty document, packed": (
        lambda d: write(d, documents()[:5] + [[]] + documents(), ids=False),
        {"data": {"pack": True}},
        r"a\.parquet row group 0: column 'input_ids' holds 1 empty or missing documents",
        "remove those rows",
    ),
    "one token per row": (
        lambda d: write(d, list(range(64))),
        {},
        r"a\.parquet row group 0: column 'input_ids' holds one token per row",
        "data.pack: true",
    ),
    "int64 token ids": (
        lambda d: write(d, windows(), dtype=pa.int64()),
        {},
        r"a\.parquet: column 'input_ids' has type list<int64>, which does not cast to int32 without loss",
        "data.columns.input_ids",
    ),
    "no sample_id column": (
        lambda d: write(d, windows(), ids=False),
        {},
        r"a\.parquet: missing column 'sample_id'",
        "data.pack",
    ),
    "files of two schemas": (
        lambda d: (write(d, windows()), write(d, windows(), name="b.parquet", dtype=pa.int16())),
        {},
        r"b\.parquet: column 'input_ids' is list<element: int16>, but list<element: int32> in .*a\.parquet",
        "the same schema",
    ),
    "no parquet file": (lambda d: d.mkdir(), {}, r"holds no \*\.parquet files", "data.path"),
    "data.path is a file": (
        lambda d: d.write_text("tokens"),
        {},
        r"data\.path '.*data' is not a directory",
        "data.path",
    ),
}


def mistake(tmp_path: Path, case: str) -> Path:
    make, changes, _, _ = CASES[case]
    make(tmp_path / "data")
    cfg = tiny_config(tmp_path, **changes)
    cfg["data"].pop("synthetic")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.invariant(13)
@pytest.mark.parametrize("case", list(CASES))
def test_a_data_mistake_is_one_line_on_the_driver_exit_2_no_worker_group(tmp_path, case, capsys, monkeypatch):
    started = []
    # where a worker group would begin
    monkeypatch.setattr(ray_resume.ray_backend, "init_ray", lambda *args: started.append(args))
    assert run.main([str(mistake(tmp_path, case))]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    _, _, says, key = CASES[case]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(says, lines[0]) and key in lines[0], lines[0]
    assert "Traceback" not in err and started == []
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("iteration_*"))


@pytest.mark.invariant(13)
def test_the_documents_case_from_the_command_line_in_seconds(tmp_path):
    """The real command, as the user ran it: exit 2, one line, Ray never started."""
    proc = subprocess.run(
        [sys.executable, "-m", "ray_resume.run", str(mistake(tmp_path, "documents without data.pack"))],
        cwd=REPO,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("set data.pack: true to pack them in windows"), proc.stderr[
        -3000:
    ]
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stdout + proc.stderr


@pytest.mark.invariant(13)
def test_the_fixed_datasets_beside_the_mistakes_pass_and_one_trains(tmp_path):
    """The same data with the key the message names: the driver's checks pass, and a run trains to its end."""
    fixed = {
        "documents, packed": (lambda d: write(d, documents(), ids=False), {"data": {"pack": True}}),
        "vocabulary raised": (lambda d: write(d, windows(top=99)), {"model": {"vocab_size": 100}}),
        "seq_len to the windows": (lambda d: write(d, windows(width=9)), {"model": {"seq_len": 8}}),
        "a smaller global batch": (lambda d: write(d, windows(n=10)), {"training": {"global_batch_size": 8}}),
    }
    for name, (make, changes) in fixed.items():
        tmp = tmp_path / name.replace(" ", "-").replace(",", "")
        make(tmp / "data")
        cfg = tiny_config(tmp, **changes)
        cfg["data"].pop("synthetic")
        assert driver_checks(cfg) is None, name  # checked, nothing to resume
    run_on_harness(cfg)  # the last one trains: 12 steps of 8 out of 10 samples, across epochs


@pytest.mark.invariant(13)
def test_without_statistics_the_read_finds_a_bad_token_and_the_run_ends_in_one_line_unretried(tmp_path):
    """A file written without statistics: the driver cannot see the ids, the read task checks each row
    group it reads (a min/max pass) and the job ends once, in one line naming the key."""
    import harness
    from conftest import read_metrics

    write(tmp_path / "data", windows(top=99), statistics=False)
    cfg = tiny_config(tmp_path)
    cfg["data"].pop("synthetic")
    assert driver_checks(cfg) is None
    outcome = harness.run_job(cfg)
    found = re.fullmatch(
        r"rank [01]: .*a\.parquet row group \d: column 'input_ids' holds token id (\d+), outside "
        r"\[0, model\.vocab_size = 64\); set model\.vocab_size: (\d+) or more",
        outcome.error,
    )
    assert found and 64 <= int(found[1]) == int(found[2]) - 1, outcome.error  # the largest id of what that read took
    assert outcome.committed is None
    assert {r["attempt"] for r in read_metrics(cfg["checkpoint"]["save_path"]) if r.get("event") == "start"} == {0}
