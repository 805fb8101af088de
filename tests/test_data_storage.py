"""A dataset on object storage (data.path: s3://...), on a moto server on loopback: one listing on
the driver, the row groups read through the store with checkpoint.storage's settings, and a run
that ends byte-identical to the same run on a local copy of the data."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import KILL_AT_6, assert_same_as_reference, run_job, run_on_harness, tiny_config
from harness import LocalStream
from ray_resume.checkpoint.io.object_store import s3_filesystem
from ray_resume.data import scan_units
from ray_resume.errors import DataError


def upload(local: str, s3: dict) -> str:
    """A copy of the dataset directory `local` under a new prefix of the `ckpts` bucket."""
    fs = s3_filesystem(s3)
    prefix = f"ckpts/data-{uuid.uuid4().hex[:8]}"
    for f in sorted(Path(local).glob("*.parquet")):
        with fs.open_output_stream(f"{prefix}/{f.name}") as out:
            out.write(f.read_bytes())
    return f"s3://{prefix}"


@pytest.mark.invariant(3)
def test_a_dataset_on_object_storage_streams_what_its_local_copy_does(s3, local_reference):
    remote = upload(local_reference["data"], s3)
    units, here = scan_units(remote, storage=s3), scan_units(local_reference["data"])
    assert [(Path(u.file).name, u.row_group, u.num_rows, u.nbytes) for u in units] == [
        (Path(u.file).name, u.row_group, u.num_rows, u.nbytes) for u in here
    ]
    for rank in (0, 1):
        a = LocalStream(units, 7, True, 16, rank, 2, 32, lanes=8, storage=s3)
        b = LocalStream(here, 7, True, 16, rank, 2, 32, lanes=8)
        remote_batches, local_batches = list(itertools.islice(a, 12)), list(itertools.islice(b, 12))
        assert len(remote_batches) == len(local_batches) == 12
        for x, y in zip(remote_batches, local_batches):
            assert x["sample_id"].tolist() == y["sample_id"].tolist() and (x["input_ids"] == y["input_ids"]).all()
        assert a.bytes_read == b.bytes_read > 0


@pytest.mark.invariant(6, 13)
def test_a_missing_prefix_or_a_file_of_another_schema_on_object_storage_is_one_line_naming_it(s3, local_reference):
    with pytest.raises(
        DataError, match=r"data.path 's3://ckpts/no-such-prefix' does not exist \(no object under that prefix\)"
    ):
        scan_units("s3://ckpts/no-such-prefix", storage=s3)
    with pytest.raises(
        DataError,
        match=r"data.path 's3://no-such-bucket/x' cannot be listed .*check the bucket, the prefix and the credentials",
    ):
        scan_units("s3://no-such-bucket/x", storage=s3)
    remote = upload(local_reference["data"], s3)
    fs = s3_filesystem(s3)
    with fs.open_output_stream(f"{remote[5:]}/part-99999.parquet") as out:
        pq.write_table(
            pa.table({"sample_id": pa.array([0], pa.int32()), "input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))}),
            out,
        )
    with pytest.raises(
        DataError, match=rf"{remote}/part-99999.parquet: column 'sample_id' has type int32, expected int64"
    ):
        scan_units(remote, storage=s3)


@pytest.mark.invariant(2, 3)
def test_a_run_on_object_storage_data_killed_mid_way_ends_as_the_run_on_local_data(tmp_path, s3, local_reference):
    cfg = tiny_config(tmp_path, checkpoint={"storage": s3})
    cfg["data"]["path"] = upload(local_reference["data"], s3)
    assert run_on_harness(cfg, KILL_AT_6).attempts == 2
    assert_same_as_reference(cfg["checkpoint"]["save_path"], local_reference)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.invariant(2, 3, 11)
def test_on_ray_the_read_tasks_reach_object_storage_and_no_key_lands_in_rays_logs(tmp_path, s3, reference):
    """Ray Data's read tasks take checkpoint.storage's keys (moto takes any): the run ends as the
    local-data one, and neither key is in any file of Ray's session directory. The reads go to
    Ray Data's tasks however cheap (data.read_tasks_above: 0).
    Not smaller: Ray Data's own read tasks must start and read from the S3 server, and the run must end, for
    its shards to be compared and Ray's logs searched."""
    keys = {"access_key_id": f"AKIA{uuid.uuid4().hex[:16].upper()}", "secret_access_key": uuid.uuid4().hex * 2}
    cfg = tiny_config(
        tmp_path,
        checkpoint={"storage": {**s3, **keys}},
        data={"read_tasks_above": 0},
    )
    cfg["data"]["path"] = upload(reference["data"], s3)
    run_job(cfg, KILL_AT_6)
    assert_same_as_reference(cfg["checkpoint"]["save_path"], reference)
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    scanned, this_job = 0, 0
    for path in (p for p in session.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # removed since the listing (a rotated log): nothing else is passed over
            continue
        scanned += 1
        this_job += f"[{cfg['name']}] step 4/12".encode() in data  # a worker's log of this very run
        assert not any(value.encode() in data for value in keys.values()), path
    assert scanned > 20 and this_job >= 1, (scanned, this_job)  # the logs of this run were among those read
