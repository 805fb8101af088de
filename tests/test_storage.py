"""Checkpoint roots on object storage and retention by save_max.

Object storage is a real S3-compatible HTTP server (moto) on loopback; the
jobs' workers reach it over HTTP exactly as they would reach S3.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

from conftest import FINAL, KILL_AT_6, per_step, read_metrics, run_on_harness, shard_bytes, tiny_config
from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.reader import read_verified
from ray_resume.checkpoint.io.iterations import find_committed, open_iteration
from ray_resume.checkpoint.commit import remove_unlisted
from ray_resume.checkpoint.format.digest import BlockDigests
from ray_resume.checkpoint.io.storage import storage_for
from ray_resume.driver import ray_checkpoint


def test_object_storage_basics(s3):
    storage = storage_for("s3://ckpts/basics", s3)
    path = "s3://ckpts/basics/iteration_00000001/common.json"
    assert storage.size(path) is None and not storage.is_dir("s3://ckpts/basics")
    storage.write_atomic(path, b'{"a": 1}')
    storage.write_atomic(path, b'{"a": 2}')
    assert storage.read_bytes(path) == b'{"a": 2}' and storage.size(path) == 8
    assert storage.read_range(path, 1, 3) == b'"a"'
    assert storage.is_dir("s3://ckpts/basics") and storage.listdir("s3://ckpts/basics") == ["iteration_00000001"]
    digest = BlockDigests("sha256", 0, [1, 4])
    assert storage.write_durable("s3://ckpts/basics/x.bin", [b"ab", b"cd"], digest) == 4
    assert storage.read_bytes("s3://ckpts/basics/x.bin") == b"abcd"
    assert digest.hexdigests() == [hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"bcd").hexdigest()]
    storage.remove_tree("s3://ckpts/basics")
    assert storage.listdir("s3://ckpts/basics") == []


def _credentials(storage) -> dict:
    """The credentials the S3 client was built with (pyarrow reports them when pickled)."""
    options = storage.backend.fs.__reduce__()[1][0]
    return {k: options[k] for k in ("access_key", "secret_key", "session_token")}


@pytest.mark.invariant(11)
def test_temporary_credentials_from_the_environment_or_the_config(s3, monkeypatch):
    """No keys in the config: the AWS credential chain, AWS_SESSION_TOKEN included (it was dropped,
    and temporary credentials failed). Keys in the config: their session_token goes with them."""
    endpoint = {"endpoint_url": s3["endpoint_url"], "region": s3["region"]}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "env-token")
    from_env = storage_for("s3://ckpts/creds", endpoint)
    # the chain's to find
    assert _credentials(from_env) == {"access_key": None, "secret_key": None, "session_token": None}
    from_env.write_atomic("s3://ckpts/creds/env.json", b"{}")  # the chain found them: moto accepts the request
    assert from_env.read_bytes("s3://ckpts/creds/env.json") == b"{}"
    explicit = storage_for("s3://ckpts/creds", {**s3, "session_token": "cfg-token"})
    assert _credentials(explicit) == {"access_key": "testing", "secret_key": "testing", "session_token": "cfg-token"}
    explicit.write_atomic("s3://ckpts/creds/cfg.json", b"{}")
    assert explicit.size("s3://ckpts/creds/cfg.json") == 2


@pytest.mark.invariant(8)
def test_a_commit_on_object_storage_leaves_only_the_files_it_lists(s3):
    """The same cleanup as on disk (tests/test_harness.py runs it in a whole job): files of an
    earlier, larger attempt and its unfinished common.json are deleted, the listed shards kept."""
    directory = "s3://ckpts/resave/iteration_00000008"
    storage = storage_for(directory, s3)
    names = [
        "ckpt-model-0000000-0000002.safetensors",
        "ckpt-model-0000002-0000003.safetensors",
        "common.json",
        "metadata.json",
    ]
    for name in names:
        storage.write_atomic(f"{directory}/{name}", b"x")
    remove_unlisted(storage, directory, {"ckpt-model-0000000-0000002.safetensors"})
    assert storage.listdir(directory) == ["ckpt-model-0000000-0000002.safetensors"]


@pytest.mark.invariant(1)
def test_small_files_go_to_object_storage_as_one_put(s3):
    """A commit writes 4 small JSON/text files; as multipart uploads they cost 3 requests each.
    S3 marks a multipart object's ETag with "-<parts>", a single PUT's is a plain MD5."""
    import boto3

    storage = storage_for("s3://ckpts/puts", s3)
    storage.write_atomic("s3://ckpts/puts/latest_checkpointed_iteration.txt", b"5\n")
    client = boto3.client(
        "s3",
        endpoint_url=s3["endpoint_url"],
        region_name=s3["region"],
        aws_access_key_id=s3["access_key_id"],
        aws_secret_access_key=s3["secret_access_key"],
    )
    etag = client.head_object(Bucket="ckpts", Key="puts/latest_checkpointed_iteration.txt")["ETag"].strip('"')
    assert etag == hashlib.md5(b"5\n").hexdigest()


class TornReadWatcher:
    """Polls the tracker and every iteration's JSON while a job saves; records any partial read.

    `json_reads` counts the JSON files it read whole (the tracker alone would not show that any was
    watched); an error that ends the polling is kept in `error`, so it cannot stop watching unseen."""

    def __init__(self, root: str, options=None):
        self.root, self.storage = root, storage_for(root, options)
        self.reads, self.json_reads, self.torn, self.error = 0, 0, [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _check(self, path: str, parse) -> bool:
        try:
            data = self.storage.read_bytes(path)
        except FileNotFoundError:
            return False  # not there (yet, or any more): fine; half there is not
        self.reads += 1
        try:
            parse(data)
        except ValueError:
            self.torn.append((path, data[:80]))
        return True

    def _run(self):
        try:
            while not self.stop.is_set():
                self._check(paths.tracker_path(self.root), lambda d: int(d.decode()))
                for name in self.storage.listdir(self.root):
                    if paths.parse_iteration_dirname(name) is not None:
                        for doc in (paths.COMMON, paths.METADATA):
                            self.json_reads += self._check(paths.join(self.root, name, doc), json.loads)
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001  (the test asserts there was none)
            self.error = exc

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        watching = self.thread.is_alive()
        self.stop.set()
        self.thread.join()
        assert watching and self.error is None, self.error  # it watched the whole job

    def saw_whole_files_only(self) -> bool:
        return self.json_reads > 0 and self.torn == []


@pytest.mark.invariant(1, 2, 3)
def test_exact_resume_on_object_storage(tmp_path, local_reference, s3):
    """On the harness (proven equal to Ray Train by tests/test_harness.py): rank processes write and read
    S3 through moto on loopback, one is killed, and the run ends as the local run does."""
    reference = local_reference
    root = "s3://ckpts/exact"
    cfg = tiny_config(
        tmp_path,
        checkpoint={"save_path": root, "storage": s3},
    )
    cfg["data"]["path"] = reference["data"]
    with TornReadWatcher(root, s3) as watcher:
        run_on_harness(cfg, KILL_AT_6)
    assert watcher.saw_whole_files_only(), (watcher.json_reads, watcher.torn)
    # The ray.train.Checkpoint a Result holds opens through the configured endpoint, not AWS's
    with ray_checkpoint(f"{root}/iteration_{FINAL:08d}", s3).as_directory() as local:
        assert json.loads((Path(local) / "common.json").read_text())["global_step"] == FINAL
    storage = storage_for(root, s3)
    assert find_committed(storage, root) == FINAL
    for step in (4, 8, FINAL):
        it = open_iteration(storage, root, step)
        files = read_verified(storage, it, sorted(it.files))
        assert files == shard_bytes(reference["root"], step), f"iteration {step} differs from the local run"
    load_state(storage, it, "opt")
    records = read_metrics(root, s3)
    # Async saves to a (slow) object store: iteration 4 may still be in flight when rank 1
    # dies at step 6, and then the restart rightly begins at 0. Never at anything else.
    assert [r["step"] for r in records if r.get("event") == "start" and r["rank"] == 0] in ([0, 4], [0, 0])
    assert {s: runs[-1]["loss"] for s, runs in per_step(records).items()} == {
        s: runs[0]["loss"] for s, runs in reference["steps"].items()
    }


def iterations(root) -> list[int]:
    return sorted(s for s in (paths.parse_iteration_dirname(p.name) for p in root.iterdir()) if s is not None)


@pytest.mark.invariant(1, 5, 10)
def test_retention_keeps_this_jobs_newest_and_never_an_earlier_jobs(tmp_path, local_reference):
    """Two whole jobs on the in-process harness; a reader polls the root all along."""
    root = tmp_path / "ckpt"
    first = tiny_config(tmp_path, training={"train_steps": 14}, checkpoint={"save_interleaved_steps": 2, "save_max": 2})
    first["data"]["path"] = local_reference["data"]
    with TornReadWatcher(str(root)) as watcher:
        run_on_harness(first)
    assert watcher.saw_whole_files_only(), (watcher.json_reads, watcher.torn)
    assert iterations(root) == [12, 14]  # 7 saves, the last 2 kept

    second = tiny_config(
        tmp_path,
        training={"train_steps": 20},
        checkpoint={"save_interleaved_steps": 2, "save_max": 1, "load_path": str(root)},
    )
    second["data"]["path"] = local_reference["data"]
    run_on_harness(second)
    # The first job's iterations stay; of its own (16, 18, 20) the second keeps 1.
    assert iterations(root) == [12, 14, 20]
    assert (root / paths.TRACKER).read_text().strip() == "20"
    for step in (12, 14):
        assert (
            json.loads((root / paths.iteration_dirname(step) / "metadata.json").read_text())["ray_resume"]["job_id"]
            != json.loads((root / paths.iteration_dirname(20) / "metadata.json").read_text())["ray_resume"]["job_id"]
        )


class StatFails:
    """A storage whose `size` of one path fails as a flaky disk's stat does."""

    def __init__(self, storage, failing: str):
        self.storage, self.failing = storage, failing

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def size(self, path: str):
        if path == self.failing:
            raise OSError(5, "injected EIO on stat", path)
        return self.storage.size(path)


@pytest.mark.invariant(5, 7)
def test_clearing_what_was_never_committed_spares_what_it_cannot_look_at(tmp_path, local_reference):
    """Below the tracker, an iteration without common.json is cleared; one whose common.json cannot be
    stat'ed (EIO) is not: an I/O error is not proof that it was never committed (the soak's review)."""
    from ray_resume.checkpoint.io.lease import LEASE_DIR
    from ray_resume.config import Config
    from ray_resume.controller.job import JobController

    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = local_reference["data"]
    run_on_harness(cfg)  # commits 4, 8, 12
    root = Path(cfg["checkpoint"]["save_path"])
    (root / paths.iteration_dirname(4) / paths.COMMON).unlink()  # 4: a deletion cut short
    controller = JobController(str(root), "clearer", Config.from_dict(cfg), driver_pid=0)
    controller.lease.acquire()
    controller.attempt = 0
    common_8 = str(root / paths.iteration_dirname(8) / paths.COMMON)
    controller.storage = StatFails(controller.storage, common_8)
    (root / paths.iteration_dirname(8) / paths.COMMON).unlink()  # 8 looks uncommitted too, but cannot be looked at
    stray = root / (paths.TRACKER + ".tmp-0badf00d")  # a tracker write a crash cut short before its rename
    stray.write_text("12")
    controller._clear_uncommitted(12, attempt=0)
    assert iterations(root) == [8, 12]  # 4 cleared; 8 spared by the error
    assert stray.exists()  # while the job runs it may be its own commit's
    controller._clear_uncommitted(12, attempt=0, ended=True)
    assert not stray.exists() and iterations(root) == [8, 12]
    controller._clear_uncommitted(12, attempt=1)  # asked by an earlier attempt than the current one: nothing
    controller.attempt = 1
    controller.lease.release()
    controller.storage = controller.storage.storage
    controller._clear_uncommitted(12, attempt=1)  # the lease is gone: nothing
    assert iterations(root) == [8, 12] and (root / LEASE_DIR).exists()
