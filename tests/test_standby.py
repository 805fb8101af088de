"""A restarted worker group lands in standby processes that were started, and had imported what a
rank imports, before the failure (ray_resume.warm)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

import ray_resume
from ray_resume.rank import process_started
from ray_resume.warm import SETUP_HOOK, waiting_here

STEPS = 4


def standby_pids(ranks: set[int]) -> set[int]:
    """This machine's processes started with the ranks' setup hook that are not ranks and hold torch's library."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ranks:
            continue
        try:
            if f"{SETUP_HOOK}=".encode() in (entry / "environ").read_bytes() and "libtorch" in (entry / "maps").read_text():
                found.add(int(entry.name))
        except OSError:  # another user's, or gone
            continue
    return found


def train_func(config: dict) -> None:
    """Each rank says its pid and when its process started; on the first attempt rank 1 waits for
    standby processes, says which they are and when, and is SIGKILLed."""
    import ray.train

    ctx = ray.train.get_context()
    rank, out = ctx.get_world_rank(), Path(config["dir"])
    ck = ray_resume.get_checkpointer()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt = "restarted" if (out / "killed.json").exists() else "first"
    (out / f"{attempt}-{rank}.json").write_text(json.dumps({"pid": os.getpid(), "started": process_started()}))
    start = ck.restore(model, opt)
    for step in range(start.step + 1, STEPS + 1):
        torch.distributed.all_reduce(torch.ones(1))  # rank 0 waits here for the lost rank 1
        if attempt == "first" and step == 2 and rank == 1:
            deadline = time.monotonic() + 120
            ranks = {json.loads((out / f"first-{r}.json").read_text())["pid"] for r in range(2)}
            while len(standby := standby_pids(ranks)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            waiting = waiting_here(ray.get_runtime_context().get_job_id())  # what the next group's request subtracts
            (out / "killed.json").write_text(json.dumps({"standby": sorted(standby), "waiting": waiting, "at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        ck.maybe_save(step, consumed_samples=step, global_batch_size=1)


@pytest.fixture
def by_value():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.usefixtures("ray_cluster", "by_value")
def test_a_restarted_group_runs_in_standby_processes_started_before_the_failure(tmp_path):
    import ray.train

    result = ray_resume.fit(train_func, train_loop_config={"dir": str(tmp_path)},
                            checkpoint={"save_path": str(tmp_path / "root"), "save_interleaved_steps": 1},
                            scaling_config=ray.train.ScalingConfig(num_workers=2), failure_config={"max_failures": 1, "standby_processes": True})
    assert result.committed_iteration == STEPS
    killed = json.loads((tmp_path / "killed.json").read_text())
    restarted = [json.loads((tmp_path / f"restarted-{rank}.json").read_text()) for rank in range(2)]
    # Both new ranks run in processes that existed, torch imported, before rank 1 was killed: not new ones.
    assert {r["pid"] for r in restarted} <= set(killed["standby"]), (restarted, killed)
    assert all(r["started"] < killed["at"] for r in restarted), (restarted, killed)
    assert killed["waiting"] == len(killed["standby"]) == 2  # the ranks' count of them, as Ray titles them


@pytest.mark.parametrize(("standby", "use_gpu", "hooked"), [("auto", False, False), ("auto", True, True), (True, False, True),
                                                            (False, True, False)])
def test_the_ranks_setup_hook_is_set_exactly_where_standby_processes_are_kept(tmp_path, standby, use_gpu, hooked):
    """`auto` keeps them for ranks on GPUs only (ranks on the CPU use its cores), and where none are
    kept no rank process runs the hook: its imports at idle priority would wait for every busy core.
    The user's own runtime env is kept either way."""
    import ray.train

    from ray_resume.config import Config
    from ray_resume.driver import RayTrain
    from ray_resume.warm import wanted
    from conftest import tiny_config

    cfg = Config.from_dict(tiny_config(tmp_path, scaling={"num_workers": 2, "use_gpu": use_gpu},
                                       failure={"standby_processes": standby}))
    yours = {"env_vars": {"MY_FLAG": "1"}, "pip": ["six"]}
    env = RayTrain(run_config=ray.train.RunConfig(worker_runtime_env=yours))._run_config(cfg, "job", None).worker_runtime_env
    assert wanted(standby, use_gpu) is hooked
    assert env == ({**yours, "env_vars": {"MY_FLAG": "1", SETUP_HOOK: "ray_resume.warm.import_rank_modules"}} if hooked else yours)


def test_a_group_counts_the_standby_processes_still_waiting_on_its_node():
    """A group asks for standby processes only up to one per rank waiting: one that was still
    importing when the group started in new processes waits for the next failure, and is counted.
    Real processes, titled as Ray titles its workers: idle, not yet titled (importing), holding an
    actor; of another job; without the hook."""
    import subprocess

    job = "0a000000"
    kinds = [("ray::IDLE", True, job), ("python", True, job), ("ray::RayTrainWorker", True, job),
             ("ray::IDLE", True, "0b000000"), ("ray::IDLE", False, job)]
    procs = [subprocess.Popen([title, "60"], executable="/bin/sleep",
                              env={"RAY_JOB_ID": other, **({SETUP_HOOK: "ray_resume.warm.import_rank_modules"} if hooked else {})})
             for title, hooked, other in kinds]
    try:
        deadline = time.monotonic() + 10  # until every child has exec'd /bin/sleep under its title
        while time.monotonic() < deadline and any(Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0] != t.encode()
                                                  for p, (t, _, _) in zip(procs, kinds)):
            time.sleep(0.05)
        assert waiting_here(job) == 2  # the idle one and the one still importing
        assert waiting_here("0c000000") == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
