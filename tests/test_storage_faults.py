"""Transient storage errors are retried, never taken for damage; persistent ones fail the job with
the error. Faults are injected below the retries by tests/storage_faults.py."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest

import harness
import storage_faults
from conftest import FINAL, shard_bytes, tiny_config
from ray_resume.checkpoint.io import storage as storage_module
from ray_resume.checkpoint.io.storage import storage_for
from test_checkpoint_format import tree


@pytest.fixture
def faults(tmp_path):
    """Install faults in this process; `injected()` lists those that fired."""
    record = str(tmp_path / "injected.jsonl")

    def install(*specs):
        storage_faults.install(list(specs), record)
        return record

    yield install
    storage_module.wrappers.clear()


@pytest.mark.invariant(7)
def test_a_transient_error_is_retried_with_backoff(tmp_path, faults, caplog):
    path = tmp_path / "f.json"
    path.write_bytes(b"{}")
    record = faults({"op": "read", "nth": 1, "times": 2, "error": "EIO"})
    with caplog.at_level(logging.WARNING):
        assert storage_for(str(tmp_path)).read_bytes(str(path)) == b"{}"
    assert len(storage_faults.injected(record)) == 2
    assert [m for m in caplog.messages if "injected EIO" in m] == [
        f"storage: read_bytes {path} failed ([Errno 5] injected EIO on read: '{path}'); try 2 of 5 in 0.2 s",
        f"storage: read_bytes {path} failed ([Errno 5] injected EIO on read: '{path}'); try 3 of 5 in 0.4 s",
    ]


@pytest.mark.invariant(7)
def test_a_persistent_error_is_raised_after_bounded_tries(tmp_path, faults):
    record = faults({"op": "list", "times": 99, "error": "timeout"})
    with pytest.raises(TimeoutError, match="injected timeout"):
        storage_for(str(tmp_path)).listdir(str(tmp_path))
    assert len(storage_faults.injected(record)) == storage_module.ATTEMPTS


@pytest.mark.parametrize("error", ["ENOENT", "EACCES", "ENOSPC"])
@pytest.mark.invariant(7)
def test_a_permanent_error_is_not_retried(tmp_path, faults, error):
    record = faults({"op": "write", "times": 99, "error": error})
    with pytest.raises(OSError, match=f"injected {error}"):
        storage_for(str(tmp_path)).write_atomic(str(tmp_path / "x"), b"x")
    assert len(storage_faults.injected(record)) == 1


@pytest.mark.invariant(7)
def test_transient_faults_while_saving_and_loading_end_byte_identical(tmp_path, local_reference):
    """A job to step 8: every rank's second shard write breaks off half way, the controller's first
    listing is reset and its first tracker write times out. A second job resumes it to the end:
    its first two shard reads and its first metadata.json read fail. All retried: the very bytes
    of the uninterrupted run."""
    cfg = tiny_config(tmp_path, training={"train_steps": 8})
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    record = str(tmp_path / "injected.jsonl")
    saving = [
        {"op": "write", "nth": 2, "path_contains": ".safetensors"},
        {"op": "list", "nth": 1, "error": "reset", "path_contains": "iteration_"},
        {"op": "write", "nth": 1, "error": "timeout", "path_contains": "latest_checkpointed_iteration.txt"},
    ]
    assert harness.run_job(cfg, storage_faults=(saving, record)).error is None
    assert {(f["method"], f["error"]) for f in storage_faults.injected(record)} == {
        ("write_durable", "EIO"),
        ("sizes", "reset"),
        ("write_atomic", "timeout"),
    }
    assert sum(f["method"] == "write_durable" for f in storage_faults.injected(record)) == 2  # one per rank

    loading = [
        {"op": "read", "nth": 1, "times": 2, "path_contains": ".safetensors"},
        {"op": "read", "nth": 1, "path_contains": "metadata.json"},
    ]
    resume = {
        **cfg,
        "training": {**cfg["training"], "train_steps": FINAL},
        "checkpoint": {**cfg["checkpoint"], "load_path": root},
    }
    Path(record).unlink()
    assert harness.run_job(resume, storage_faults=(loading, record)).error is None
    assert {(f["method"], f["error"]) for f in storage_faults.injected(record)} == {
        ("open_read", "EIO"),
        ("read_bytes", "EIO"),
    }
    for step in (4, 8, FINAL):
        assert shard_bytes(root, step) == shard_bytes(local_reference["root"], step), step


@pytest.mark.invariant(7)
def test_a_read_that_keeps_failing_fails_the_job_and_sets_nothing_aside(tmp_path, local_reference):
    root = tmp_path / "from"
    shutil.copytree(local_reference["root"], root)
    before = tree(root)
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(root)}, failure={"max_failures": 0})
    cfg["data"]["path"] = local_reference["data"]
    specs = [{"op": "read", "times": 10**6, "path_contains": ".safetensors"}]
    record = str(tmp_path / "injected.jsonl")
    outcome = harness.run_job(cfg, storage_faults=(specs, record))
    # A rank raised the OSError and exited (see its log): not a user's mistake, not a failed commit.
    assert re.fullmatch(r"rank [01] exited with 1", outcome.error or ""), outcome.error
    per_process: dict[int, int] = {}
    for f in storage_faults.injected(record):
        per_process[f["pid"]] = per_process.get(f["pid"], 0) + 1
    assert storage_module.ATTEMPTS in per_process.values()  # bounded: the failing rank tried 5 times, then gave up
    assert tree(root) == before  # no fallback, nothing renamed aside
    assert not any(p.name.endswith(".damaged") or ".damaged-" in p.name for p in Path(root).iterdir())


@pytest.mark.parametrize(
    "exc, retry",
    [
        (
            OSError(
                "When reading information for key 'k' in bucket 'b': AWS Error SLOW_DOWN during HeadObject operation"
            ),
            True,
        ),
        (OSError("When uploading part: AWS Error NETWORK_CONNECTION during UploadPart operation: curlCode: 7"), True),
        (
            OSError(
                "When getting information for key 'k': AWS Error UNKNOWN (HTTP status 503) during HeadObject operation"
            ),
            True,
        ),
        (OSError("When getting information for key 'k': AWS Error ACCESS_DENIED during HeadObject operation"), False),
        (FileNotFoundError(2, "no such file"), False),
        (PermissionError(13, "denied"), False),
        (ConnectionResetError(104, "reset"), True),
    ],
)
@pytest.mark.invariant(7)
def test_which_errors_are_transient(exc, retry):
    """pyarrow's S3 errors carry no errno: what they say decides (its own retry strategy went first)."""
    assert storage_module.transient(exc) is retry
