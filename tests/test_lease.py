"""One writer per save_path."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from conftest import REPO, env_for_subprocess, run_job, tiny_config
from ray_resume.checkpoint.io import lease as lease_module
from ray_resume.checkpoint.io.lease import LEASE_DIR, Lease
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.format import state
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import save_shards
from test_checkpoint_format import make_state


def generations(root) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((root / LEASE_DIR).glob("*.json"))}


@pytest.mark.invariant(9)
def test_a_live_lease_refuses_a_second_writer_naming_the_holder(tmp_path):
    first = Lease(LocalStorage(), str(tmp_path), "job-a", ttl_s=60)
    first.acquire()
    with pytest.raises(CheckpointError) as err:
        Lease(LocalStorage(), str(tmp_path), "job-b", ttl_s=60).acquire()
    assert f"checkpoint.save_path {str(tmp_path)!r} is being written by job job-a" in str(err.value)
    first.acquire()  # the same job (a restarted worker group) keeps it
    first.release()
    assert [(r["job_id"], r["expires_at"], r["released"]) for r in generations(tmp_path).values()] == [
        ("job-a", 0, True)
    ]
    second = Lease(LocalStorage(), str(tmp_path), "job-b", ttl_s=60)
    second.acquire()
    assert second.generation == 2 and list(generations(tmp_path)) == ["00000002.json"]  # numbers never restart


@pytest.mark.parametrize(
    "record",
    [
        {"job_id": "dead-elsewhere", "host": "another-host", "pid": 1, "expires_at": 0},  # expired
        {"job_id": "dead-here", "host": None, "pid": 2**22 + 7, "expires_at": 4e9},  # this host, process gone
    ],
)
@pytest.mark.invariant(9)
def test_a_dead_jobs_lease_is_taken_over_by_the_next_generation(tmp_path, record, caplog):
    import socket

    record = {**record, "host": record["host"] or socket.gethostname()}
    (tmp_path / LEASE_DIR).mkdir()
    (tmp_path / LEASE_DIR / "00000001.json").write_text(json.dumps(record))
    Lease(LocalStorage(), str(tmp_path), "job-new", ttl_s=60).acquire()
    assert [(name, r["job_id"]) for name, r in generations(tmp_path).items()] == [("00000002.json", "job-new")]
    assert f"taking over the expired lease of job {record['job_id']}" in caplog.text


class ListedTogether(LocalStorage):
    """Storage on which two jobs' takeovers interleave: each lists the lease's generations, then
    waits until the other has listed too, so both decide on the same next generation."""

    def __init__(self, barrier: threading.Barrier, conditional: bool):
        self.barrier, self.listed = barrier, False
        if not conditional:  # as on object storage: no create-if-absent
            self.create_new = None

    def listdir(self, path):
        names = super().listdir(path)
        if path.endswith(LEASE_DIR) and not self.listed:
            self.listed = True
            self.barrier.wait(timeout=10)
        return names


@pytest.mark.parametrize("conditional", [True, False], ids=["posix-link", "object-store-readback"])
@pytest.mark.invariant(9)
def test_two_jobs_taking_over_at_the_same_instant_one_wins(tmp_path, conditional, monkeypatch):
    monkeypatch.setattr(lease_module, "SETTLE_S", 0.3)
    (tmp_path / LEASE_DIR).mkdir()
    (tmp_path / LEASE_DIR / "00000001.json").write_text(
        json.dumps({"job_id": "dead", "host": "h", "pid": 1, "expires_at": 0})
    )
    barrier = threading.Barrier(2)
    outcome = {}

    def take(job):
        lease = Lease(ListedTogether(barrier, conditional), str(tmp_path), job, ttl_s=60)
        try:
            lease.acquire()
            outcome[job] = "holds"
        except CheckpointError as exc:
            outcome[job] = str(exc)

    threads = [threading.Thread(target=take, args=(job,)) for job in ("job-a", "job-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [job for job, got in outcome.items() if got == "holds"]
    [loser] = set(outcome) - set(winners)
    assert len(winners) == 1, outcome
    assert "another job took the lease" in outcome[loser]
    assert [r["job_id"] for r in generations(tmp_path).values()] == winners


@pytest.mark.invariant(9)
def test_a_commit_is_fenced_by_the_lease(tmp_path):
    """A job whose lease was taken over (it stalled past its ttl) writes nothing: no JSON, no tracker."""
    from ray_resume.checkpoint.commit import commit_iteration
    from ray_resume.errors import LeaseLost

    storage = LocalStorage()
    stalled = Lease(storage, str(tmp_path), "job-stalled", ttl_s=60)
    stalled.acquire()
    (tmp_path / LEASE_DIR / "00000002.json").write_text(
        json.dumps({"job_id": "job-new", "host": "h", "pid": 1, "expires_at": 4e9})
    )
    model, opt = make_state()
    manifest = save_shards(
        storage,
        str(tmp_path),
        8,
        prefix="ckpt",
        rank=0,
        world_size=1,
        model_state=state.model_tensors(model),
        optim_state=opt.state_tensors(),
        rank_extras={},
    )
    shards = sorted(p.name for p in (tmp_path / "iteration_00000008").iterdir())
    with pytest.raises(LeaseLost, match="job-stalled.* no longer holds the writer lease.*job job-new took it over"):
        common = {
            "global_step": 8,
            "global_batch_size": 8,
            "step_num": 8,
            "epoch_num": 0,
            "loss_scale": 1.0,
            "consumed_samples": 64,
        }
        commit_iteration(
            storage,
            str(tmp_path),
            8,
            [manifest],
            common,
            prefix="ckpt",
            config={},
            job_id="job-stalled",
            fence=stalled.check,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [LEASE_DIR, "iteration_00000008"]  # no tracker
    assert sorted(p.name for p in (tmp_path / "iteration_00000008").iterdir()) == shards  # no JSON
    with pytest.raises(LeaseLost):
        stalled.renew()  # and its renewals stop: the newer generation is another job's


@pytest.mark.invariant(9)
def test_a_stalled_job_whose_lease_was_taken_and_released_stays_out(tmp_path):
    """A stalls past its ttl; B takes over, finishes and releases. A's renewal must not bring its old
    generation back to life, and its fence must keep failing."""
    from ray_resume.errors import LeaseLost

    stalled = Lease(LocalStorage(), str(tmp_path), "job-a", ttl_s=60)
    stalled.acquire()
    path = tmp_path / LEASE_DIR / "00000001.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": 0}))  # its lease ran out
    taker = Lease(LocalStorage(), str(tmp_path), "job-b", ttl_s=60)
    taker.acquire()
    taker.release()
    with pytest.raises(LeaseLost):
        stalled.renew()
    with pytest.raises(LeaseLost):
        stalled.check()
    assert [r["job_id"] for r in generations(tmp_path).values()] == ["job-b"]


@pytest.mark.invariant(9)
def test_a_lease_about_to_run_out_fences_too(tmp_path):
    """Renewals failing: with less than ttl/3 left, committing could race a takeover."""
    from ray_resume.errors import LeaseLost

    lease = Lease(LocalStorage(), str(tmp_path), "job-a", ttl_s=60)
    lease.acquire()
    lease.check()
    path = tmp_path / LEASE_DIR / "00000001.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": time.time() + 10}))
    with pytest.raises(LeaseLost, match=r"runs out in (\d+) s \(renewals are failing\)") as caught:
        lease.check()
    # 10 s less what passed since the write (it read 9 on a loaded machine): never more, never run out
    assert 0 < int(re.search(r"runs out in (\d+) s", str(caught.value))[1]) <= 10


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.invariant(9, 13)
def test_two_real_jobs_on_one_save_path(tmp_path, reference):
    """A second `python -m ray_resume.run` on a save_path a running job holds is refused, naming the holder,
    and the first job finishes and releases it. Not smaller: two real jobs, the first long enough (40
    steps) for the second to meet its lease."""
    cfg = tiny_config(tmp_path, training={"train_steps": 40})
    cfg["data"]["path"] = reference["data"]
    cfg["checkpoint"]["load_path"] = cfg["checkpoint"]["save_path"]
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
        while not generations(tmp_path / "ckpt"):
            assert time.time() < deadline
            time.sleep(0.2)
        [holder] = [r["job_id"] for r in generations(tmp_path / "ckpt").values()]
        path = tmp_path / "second.yaml"
        path.write_text(yaml.safe_dump(cfg))
        second = subprocess.run(
            [sys.executable, "-m", "ray_resume.run", str(path)],
            cwd=REPO,
            env=env_for_subprocess(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is being written by job {holder}" in second.stderr
    finally:
        first.join()
    assert "error" not in outcome, outcome.get("error")
    # released when the first job finished
    assert [r["released"] for r in generations(tmp_path / "ckpt").values()] == [True]
