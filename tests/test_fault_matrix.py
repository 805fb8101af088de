"""Fault matrix, the faults nobody injects from inside: a worker process SIGKILLed from
outside at a random moment, and a whole node removed from a multi-node cluster.

Either way Ray Train restarts the worker group, the job resumes from its newest
committed iteration by itself, and it ends with shard files byte-identical to the
uninterrupted reference run and the very same per-step losses (invariants 2 and 3).

Both jobs train with the built-in loss slowed by a sleep (same numbers, more wall
time per step), so that a fault drawn at random lands inside the training steps
rather than after them: unslowed, the 12 tiny steps take about half a second.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import ray._private.state

from conftest import FINAL, assert_same_as_reference, run_driver, tiny_config
from ray_resume.checkpoint import paths
from ray_resume.plugins import next_token_loss
from ray_resume.api import train


MICRO_BATCHES = 2  # tiny_config: global batch 16 = 2 workers x micro batch 4 x 2 accumulation steps


def slow_loss(step_sleep: float, marks: Path | None = None):
    """The built-in loss (the same numbers), `step_sleep` seconds slower per micro-batch.

    With `marks`, each process that computes it leaves a file named by its pid there:
    proof that this pid is a training worker of this very job, and that it is training.
    Nested, so that cloudpickle ships it to the workers by value.
    """

    def loss(model, batch):
        if marks is not None:
            (marks / str(os.getpid())).touch()
        time.sleep(step_sleep)
        return next_token_loss(model, batch)

    return loss


def alive_train_worker_pids() -> set[int]:
    """Pids of the live `RayTrainWorker` actors of the session Ray, from its GCS actor table.

    `ray.util.state.list_actors` is not usable here: it needs the dashboard, which the
    session Ray runs without, and with no address it picks the newest Ray on the machine,
    which may be another test's.
    """
    actors = ray._private.state.actors(actor_state_name="ALIVE")
    return {a["Pid"] for a in actors.values() if a["ActorClassName"] == "RayTrainWorker" and a["Pid"]}


def tracker_value(root) -> int | None:
    try:
        return int(Path(paths.tracker_path(str(root))).read_text().strip())
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# 1. SIGKILL of a training worker process from outside, at a random moment.

STEP_SLEEP = 0.15  # seconds per micro-batch: ~0.3 s per step, ~4 s for the 12 steps


@pytest.mark.parametrize("seed", [0])  # more seeds, in seconds each, on the harness (tests/test_harness.py)
@pytest.mark.invariant(1, 2, 3)
def test_worker_sigkilled_from_outside_at_a_random_moment(tmp_path, reference, ray_cluster, seed):
    rng = random.Random(seed)
    # Uniform over the training window: from the first micro-batch to before the last step ends
    # (a busier host only makes the steps slower, so the kill lands earlier in the run, never after it).
    delay = rng.uniform(0.0, (FINAL - 1) * MICRO_BATCHES * STEP_SLEEP)
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = reference["data"]
    root = cfg["checkpoint"]["save_path"]
    marks = tmp_path / "marks"
    marks.mkdir()

    outcome = {}

    def job():
        try:
            outcome["result"] = train(cfg, loss=slow_loss(STEP_SLEEP, marks))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test thread)
            outcome["raised"] = exc

    thread = threading.Thread(target=job, name=f"fault-matrix-job-{seed}", daemon=True)
    thread.start()
    try:
        deadline = time.time() + 600
        while not any(marks.iterdir()):  # the first training step has begun
            assert thread.is_alive(), f"the job ended before training started: {outcome}"
            assert time.time() < deadline, "training never started"
            time.sleep(0.05)
        time.sleep(delay)
        # Only this job runs on the session Ray now; a pid must also have trained for this job.
        candidates = sorted(alive_train_worker_pids() & {int(p.name) for p in marks.iterdir()})
        assert candidates, "no live training worker of this job to kill"
        victim = rng.choice(candidates)
        committed_before = tracker_value(root)
        assert thread.is_alive(), "the job finished before the kill"
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
    finally:
        thread.join(timeout=600)
    assert not thread.is_alive(), "the job did not finish within 10 minutes"
    assert "raised" not in outcome, outcome.get("raised")
    result = outcome["result"]
    assert result.committed_iteration == FINAL

    restarts = assert_same_as_reference(root, reference)
    # The kill restarted the group once, and it resumed from a commit no older than the
    # tracker's value at the moment of the kill.
    assert [r["attempt"] for r in restarts] == [0, 1], restarts
    resumed = restarts[1]["step"]
    assert resumed in (0, 4, 8, FINAL) and resumed >= (committed_before or 0), (resumed, committed_before)
    if resumed:
        assert restarts[1]["source"].endswith(f"iteration_{resumed:08d}")
    assert restarts[1]["time"] > killed_at - 1.0
    print(f"seed {seed}: killed pid {victim} {delay:.2f} s into training, tracker at {committed_before}; "
          f"resumed from step {resumed}")


# ---------------------------------------------------------------------------------------------
# 2. Node loss: the node that holds both training workers is removed mid-run.

NODE_LOSS_DRIVER = r'''
"""Driver of the node-loss test: a multi-node Ray of its own (ray.cluster_utils.Cluster)."""
import json
import socket
import sys
import threading
import time
from pathlib import Path

import ray
import ray._private.state
from ray.cluster_utils import Cluster

from ray_resume.checkpoint import paths
from ray_resume.plugins import next_token_loss
from ray_resume.api import train


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_workers():
    return sorted([a["Address"]["NodeID"], a["State"], a["Pid"]] for a in ray._private.state.actors().values()
                  if a["ActorClassName"] == "RayTrainWorker")


def main():
    t0 = time.time()
    cfg = json.loads(Path(sys.argv[1]).read_text())
    step_sleep = float(sys.argv[2])
    tracker = Path(paths.tracker_path(cfg["checkpoint"]["save_path"]))
    node = {"object_store_memory": 100 * 1024**2}
    # The head has no CPU: the driver, the checkpoint coordinator and Ray Train's controller
    # (num_cpus=0 each) live there, and everything that needs a CPU -- both training workers
    # and the Ray Data read tasks -- must go to a worker node.
    cluster = Cluster(initialize_head=True, head_node_args={
        **node, "num_cpus": 0, "include_dashboard": False,
        "dashboard_agent_listen_port": free_port(),  # the default one is the session Ray's
        # A node that vanishes is declared dead after 5 missed health checks: 5 s, not Ray's 15 s.
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}})
    first = cluster.add_node(num_cpus=4, **node)
    ray.init(address=cluster.address)
    out = {"first_node": first.node_id, "cluster_up_s": time.time() - t0}

    def slow_loss(model, batch):  # the built-in loss, slowed so that the removal lands mid-run
        time.sleep(step_sleep)
        return next_token_loss(model, batch)

    result = {}

    def job():
        try:
            r = train(cfg, loss=slow_loss)
            result.update(committed=r.committed_iteration, error=None)
        except BaseException as exc:  # reported to the test
            result.update(committed=None, error=repr(exc))

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    deadline = time.time() + 400
    while not tracker.exists() and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    out["tracker_at_removal"] = tracker.read_text().strip() if tracker.exists() else None
    out["workers_before"] = train_workers()
    out["job_alive_at_removal"] = thread.is_alive()
    # Abruptly, as a machine that dies: SIGKILL to its raylet, object store and workers,
    # both training workers among them.
    cluster.remove_node(first, allow_graceful=False)
    out["removed_at"] = time.time()
    out["first_commit_s"] = out["removed_at"] - t0
    second = cluster.add_node(num_cpus=4, **node)  # from the main thread, as Cluster wants
    out["second_node"] = second.node_id
    out["replacement_up_s"] = time.time() - out["removed_at"]
    thread.join(timeout=400)
    out["job_finished"] = not thread.is_alive()
    out["job_done_s"] = time.time() - t0
    out["workers_after"] = train_workers()
    out.update(result)
    print("RESULT " + json.dumps(out), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
'''


@pytest.mark.invariant(1, 2, 3)
def test_node_holding_the_workers_removed_mid_run(tmp_path, reference):
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = reference["data"]
    root = cfg["checkpoint"]["save_path"]
    (tmp_path / "job.json").write_text(json.dumps(cfg))
    res, out = run_driver(tmp_path, NODE_LOSS_DRIVER, str(tmp_path / "job.json"), "0.25")
    assert res["error"] is None and res["committed"] == FINAL, (res, out[-5000:])

    # Both workers were on the removed node, and were alive and training when it went.
    assert res["job_alive_at_removal"] and res["tracker_at_removal"] is not None
    assert [(n, s) for n, s, _ in res["workers_before"]] == [(res["first_node"], "ALIVE")] * 2
    # The restarted group ran on the replacement node.
    assert sorted(n for n, _, _ in res["workers_after"]) == sorted([res["first_node"]] * 2 + [res["second_node"]] * 2)

    restarts = assert_same_as_reference(root, reference)
    assert [r["attempt"] for r in restarts] == [0, 1], restarts
    assert restarts[1]["step"] >= int(res["tracker_at_removal"]) > 0
    assert restarts[1]["source"].endswith(f"iteration_{restarts[1]['step']:08d}")
    print("node loss: cluster up {cluster_up_s:.0f} s, node removed at {first_commit_s:.0f} s (tracker at "
          "{tracker_at_removal}), replacement up after {replacement_up_s:.0f} s, job done at {job_done_s:.0f} s; "
          "resumed from step {step}".format(step=restarts[1]["step"], **res))
