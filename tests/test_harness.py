"""Whole jobs on the in-process harness (tests/harness.py): real gloo ranks, the real loop,
Checkpointer, commit and controller, no Ray. Each fault phase, the commit, retention and
resharding, in seconds; the Ray Train runs in tests/test_resume_e2e.py show what only Ray can."""

from __future__ import annotations

import pytest

import harness
from conftest import FINAL, assert_same_as_reference, per_step, read_metrics, shard_bytes, tiny_config


def run(cfg: dict) -> harness.Outcome:
    outcome = harness.run_job(cfg)
    assert outcome.error is None and not outcome.driver_killed, outcome
    assert outcome.committed == cfg["training"]["train_steps"]
    return outcome


def starts(root) -> list[dict]:
    return [r for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0]


def test_a_job_on_the_harness_is_the_same_job_as_on_ray_train(tmp_path, reference):
    """Same bytes at every iteration, same loss and samples at every step as the Ray Train run:
    what the harness shows holds for the product."""
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = reference["data"]
    run(cfg)
    root = cfg["checkpoint"]["save_path"]
    for step in (4, 8, FINAL):
        assert shard_bytes(root, step) == shard_bytes(reference["root"], step), step
    assert per_step(read_metrics(root)) == reference["steps"]


@pytest.mark.parametrize("phase", ["mid_shard_write", "before_report"])
def test_crash_while_saving_never_loads_the_half_written_iteration(tmp_path, reference, phase):
    cfg = tiny_config(tmp_path, fault={"phase": phase, "step": 8, "rank": 1})
    cfg["data"]["path"] = reference["data"]
    assert run(cfg).attempts == 2
    root = cfg["checkpoint"]["save_path"]
    restarts = starts(root)
    # Iteration 8 was being written when rank 1 died: the restart must use 4.
    assert [r["step"] for r in restarts] == [0, 4]
    assert restarts[1]["source"].endswith("iteration_00000004")
    # 8 was saved again by the new attempt and replaced cleanly: the very bytes of the reference.
    assert_same_as_reference(root, reference)
