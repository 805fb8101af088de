"""One writer per save_path."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import yaml

from conftest import REPO, env_for_subprocess, run_job, tiny_config
from ray_resume.checkpoint.lease import LEASE, Lease
from ray_resume.checkpoint.schema import CheckpointError
from ray_resume.checkpoint.storage import LocalStorage


def test_a_live_lease_refuses_a_second_writer_naming_the_holder(tmp_path):
    first = Lease(LocalStorage(), str(tmp_path), "job-a", ttl_s=60)
    first.acquire()
    with pytest.raises(CheckpointError) as err:
        Lease(LocalStorage(), str(tmp_path), "job-b", ttl_s=60).acquire()
    assert f"checkpoint.save_path {str(tmp_path)!r} is being written by job job-a" in str(err.value)
    first.acquire()  # the same job (a restarted worker group) keeps it
    first.release()
    assert not (tmp_path / LEASE).exists()
    Lease(LocalStorage(), str(tmp_path), "job-b", ttl_s=60).acquire()


@pytest.mark.parametrize("record", [
    {"job_id": "dead-elsewhere", "host": "another-host", "pid": 1, "expires_at": 0},  # expired
    {"job_id": "dead-here", "host": None, "pid": 2**22 + 7, "expires_at": 4e9},  # this host, process gone
])
def test_a_dead_jobs_lease_is_taken_over(tmp_path, record, caplog):
    import socket

    record = {**record, "host": record["host"] or socket.gethostname()}
    (tmp_path / LEASE).write_text(json.dumps(record))
    Lease(LocalStorage(), str(tmp_path), "job-new", ttl_s=60).acquire()
    assert json.loads((tmp_path / LEASE).read_text())["job_id"] == "job-new"
    assert f"taking over the expired lease of job {record['job_id']}" in caplog.text


@pytest.mark.usefixtures("ray_cluster")
def test_two_real_jobs_on_one_save_path(tmp_path, reference):
    cfg = tiny_config(tmp_path, training={"train_steps": 40})
    cfg["data"]["path"] = reference["data"]
    cfg["checkpoint"]["load_path"] = cfg["checkpoint"]["save_path"]
    lease_file = tmp_path / "ckpt" / LEASE
    outcome = {}

    def first_job():
        try:
            outcome["result"] = run_job(cfg)
        except BaseException as exc:  # surfaced below: a thread's exception is otherwise lost
            outcome["error"] = exc

    first = threading.Thread(target=first_job)
    first.start()
    try:
        deadline = time.time() + 60
        while not lease_file.exists():
            assert time.time() < deadline
            time.sleep(0.2)
        holder = json.loads(lease_file.read_text())["job_id"]
        path = tmp_path / "second.yaml"
        path.write_text(yaml.safe_dump(cfg))
        second = subprocess.run([sys.executable, "-m", "ray_resume.run", str(path)], cwd=REPO, env=env_for_subprocess(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is being written by job {holder}" in second.stderr
    finally:
        first.join()
    assert "error" not in outcome, outcome.get("error")
    assert not lease_file.exists()  # released when the first job finished
