"""Fault matrix, the fault nobody injects from inside: a worker process SIGKILLed from
outside at a random moment. Ray Train restarts the worker group, the job resumes from its
newest committed iteration by itself, and it ends with shard files byte-identical to the
uninterrupted reference run and the very same per-step losses (invariants 2 and 3).

A whole node lost mid-run is in tests/test_elastic_cluster.py (the node of a training
worker removed, the group back on the survivor from the newest commit, every step's
samples the reference's) and tests/test_memory_tier.py (the node of a rank removed while
it trains, back from memory, byte-identical): one multi-node Cluster each.

The job trains with the built-in loss slowed by a sleep (same numbers, more wall
time per step), so that a fault drawn at random lands inside the training steps
rather than after them: unslowed, the 12 tiny steps take about half a second.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import ray._private.state

from conftest import FINAL, assert_same_as_reference, tiny_config
from ray_resume.checkpoint.format import paths
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
    """A SIGKILL from outside Ray, at a random moment of a real Ray Train job, ends with every committed
    iteration sound and the run finished. Not smaller: one job and its restart on Ray Train (one seed here;
    the harness runs more in seconds each)."""
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
    print(
        f"seed {seed}: killed pid {victim} {delay:.2f} s into training, tracker at {committed_before}; "
        f"resumed from step {resumed}"
    )
