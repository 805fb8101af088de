"""Whole jobs on the in-process harness (tests/harness.py): real gloo ranks, the real loop,
Checkpointer, commit and controller, no Ray. Each fault phase, the commit, retention and
resharding, in seconds; the Ray Train runs in tests/test_resume_e2e.py show what only Ray can."""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

import harness
from conftest import (
    FINAL,
    KILL_AT_6,
    STORAGE_SECRETS,
    assert_same_as_reference,
    per_step,
    read_metrics,
    run_on_harness,
    shard_bytes,
    tiny_config,
)
from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.io.iterations import check_no_extra_shards, open_iteration
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.plugins import next_token_loss


def starts(root) -> list[dict]:
    return [r for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0]


@pytest.mark.invariant(2, 3)
def test_a_job_on_the_harness_is_the_same_job_as_on_ray_train(local_reference, reference):
    """Same bytes at every iteration, same loss and samples at every step as the Ray Train run:
    what the harness shows holds for the product."""
    for step in (4, 8, FINAL):
        assert shard_bytes(local_reference["root"], step) == shard_bytes(reference["root"], step), step
    assert local_reference["steps"] == reference["steps"]


@pytest.mark.parametrize(
    "phase, writer", [("mid_shard_write", "process"), ("mid_shard_write", "thread"), ("before_report", "auto")]
)
@pytest.mark.invariant(1, 2, 3, 4, 8)
def test_crash_while_saving_never_loads_the_half_written_iteration(tmp_path, local_reference, phase, writer):
    """A rank SIGKILLed half way through writing a shard (with its writer process waiting on it, or
    its writer thread), or after writing but before reporting. Rank 0's write of iteration 4 is slowed, as
    a writer in SCHED_IDLE on a busy machine is, so that rank 1 reaches 8 before 4 is committed; the fault
    fires once it is (CommitsFirst)."""
    cfg = tiny_config(tmp_path, checkpoint={"async_writer": writer})
    cfg["data"]["path"] = local_reference["data"]
    slow_4 = [{"op": "write", "times": 0, "delay_s": 1.5, "path_contains": "iteration_00000004/ckpt-model-0000000"}]
    faults = (slow_4, str(tmp_path / "injected.jsonl"))
    fault = {"phase": phase, "step": 8, "rank": 1}
    assert run_on_harness(cfg, fault, controller="CommitsFirst", storage_faults=faults).attempts == 2
    root = cfg["checkpoint"]["save_path"]
    restarts = starts(root)
    # Iteration 8 was being written when rank 1 died: the restart must use 4.
    assert [r["step"] for r in restarts] == [0, 4]
    assert restarts[1]["source"].endswith("iteration_00000004")
    # 8 was saved again by the new attempt and replaced cleanly: the very bytes of the reference run.
    assert_same_as_reference(root, local_reference)
    # The last (async) save was waited for by every rank of the last attempt before it returned.
    waits = [r for r in read_metrics(root) if r.get("event") == "save_wait"]
    assert {r["rank"] for r in waits if r["attempt"] == restarts[1]["attempt"]} == {0, 1}


def test_async_save_auto_is_decided_by_rank_0_for_every_rank_and_said_in_the_summary(tmp_path, caplog):
    """`checkpoint.async_save: auto` on a job saving every 2 steps: its 4th save (step 8) decides, every
    rank records rank 0's verdict, and the run's summary line says it."""
    cfg = tiny_config(tmp_path, checkpoint={"save_interleaved_steps": 2, "async_save": "auto"})
    with caplog.at_level(logging.INFO, logger="ray_resume"):
        run_on_harness(cfg)
    records = read_metrics(cfg["checkpoint"]["save_path"])
    chosen = {r["rank"]: (r["step"], r["why"]) for r in records if r.get("event") == "async_save_auto"}
    assert chosen.keys() == {0, 1} and chosen[0] == chosen[1] and chosen[0][0] == 8, chosen
    why = chosen[0][1]
    assert re.fullmatch(r"(async|sync): a sync save blocked training \d+\.\d{3} s, an async one .+ in all\)", why), why
    summary = [r.getMessage() for r in caplog.records if "saves; training blocked" in r.getMessage()]
    assert len(summary) == 1 and summary[0].endswith(f"; checkpoint.async_save auto chose {why}"), summary


@pytest.mark.invariant(2, 3)
def test_fsdp_rank_killed_resumes_exactly(tmp_path, local_reference):
    """Under strategy fsdp (FSDP2 dim-0 shards) an interrupted run also ends byte-identical to its
    uninterrupted twin, with the same samples at every step as under DDP."""
    fsdp = {"training": {"strategy": "fsdp"}}
    clean = tiny_config(tmp_path / "clean", **fsdp)
    clean["data"]["path"] = local_reference["data"]
    run_on_harness(clean)
    twin = {"root": clean["checkpoint"]["save_path"], "steps": per_step(read_metrics(clean["checkpoint"]["save_path"]))}
    cfg = tiny_config(tmp_path / "faulty", checkpoint={"async_save": False}, **fsdp)
    cfg["data"]["path"] = local_reference["data"]
    run_on_harness(cfg, KILL_AT_6)
    root = cfg["checkpoint"]["save_path"]
    assert [r["step"] for r in starts(root)] == [0, 4]
    assert_same_as_reference(root, twin)
    it = open_iteration(LocalStorage(), root, FINAL)
    # Every model tensor with rows to cut is stored as the two ranks held it: one chunk of rows each.
    assert {len(t.pieces) for t in it.tensors["model"].values()} == {2}
    for step, runs in twin["steps"].items():  # FSDP changes where the state lives, not which samples a step sees
        assert runs[0]["ids"] == local_reference["steps"][step][0]["ids"]


def tracker(root) -> str:
    return Path(paths.tracker_path(str(root))).read_text().strip()


@pytest.mark.invariant(1, 4, 9, 10)
def test_driver_killed_between_json_and_tracker_resumes_from_the_last_commit(tmp_path, local_reference):
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    assert harness.run_job(cfg, fault={"phase": "commit_before_tracker", "step": 8}).driver_killed
    # The JSON of iteration 8 is on disk, but the tracker never moved past 4.
    assert (Path(root) / "iteration_00000008" / "metadata.json").exists() and tracker(root) == "4"
    # The same config again, without load_path, would overwrite a committed root: refused on the driver.
    with pytest.raises(CheckpointError, match="already holds committed iteration 4 .* set checkpoint.load_path"):
        harness.run_job(cfg)
    # the dead driver's lease is taken over
    run_on_harness({**cfg, "checkpoint": {**cfg["checkpoint"], "load_path": root}})
    [start] = starts(root)[-1:]
    assert start["source"].endswith("iteration_00000004")  # never the half-committed 8
    for step in (8, FINAL):  # 8 was written again and replaced cleanly
        assert shard_bytes(root, step) == shard_bytes(local_reference["root"], step)


@pytest.mark.invariant(1, 5)
def test_driver_killed_during_retention_deletion_leaves_a_loadable_root(tmp_path, local_reference):
    # save_max 1: committing 8 deletes 4, and the driver dies half way through that deletion.
    cfg = tiny_config(tmp_path, checkpoint={"save_max": 1})
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    assert harness.run_job(cfg, fault={"phase": "retention_delete", "step": 4}).driver_killed
    assert tracker(root) == "8"
    half_deleted = Path(root) / "iteration_00000004"
    assert half_deleted.exists() and not (half_deleted / "common.json").exists()  # never passes as complete
    run_on_harness({**cfg, "checkpoint": {**cfg["checkpoint"], "load_path": root}})
    assert starts(root)[-1]["source"].endswith("iteration_00000008")
    assert shard_bytes(root, FINAL) == shard_bytes(local_reference["root"], FINAL)
    # The resumed job keeps its own newest (12), leaves the first job's 8 alone, and clears what is left
    # of 4 (no common.json: nothing can ever load it), found by the soak (benchmarks/soak.py, seed 1).
    kept = sorted(p.name for p in Path(root).iterdir() if p.name.startswith("iteration_"))
    assert kept == ["iteration_00000008", "iteration_00000012"]


@pytest.mark.invariant(5)
def test_a_deletion_cut_short_at_the_last_commit_is_cleared_by_the_next_job_with_nothing_to_do(
    tmp_path, local_reference
):
    """save_max 1: committing the last step (12) deletes 8, and the driver dies half way through. The job
    resubmitted has nothing left to train and commits nothing; as it ends it clears what is left of 8
    (found by the soak, benchmarks/soak.py seed 1: it stayed for good)."""
    cfg = tiny_config(tmp_path, checkpoint={"save_max": 1})
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    assert harness.run_job(cfg, fault={"phase": "retention_delete", "step": 8}).driver_killed
    assert tracker(root) == str(FINAL)
    assert (Path(root) / "iteration_00000008").exists()
    again = harness.run_job({**cfg, "checkpoint": {**cfg["checkpoint"], "load_path": root}})
    assert again.error is None and again.committed is None  # nothing to do, nothing committed
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("iteration_")) == [f"iteration_{FINAL:08d}"]


@pytest.mark.invariant(5)
def test_training_goes_on_while_retention_deletes(tmp_path, local_reference):
    """A deletion that blocks until the job commits again is released by that commit: the ranks
    asked, trained, saved and committed while it was still running (an ordering, not a timing)."""
    cfg = tiny_config(tmp_path, checkpoint={"save_max": 1})
    cfg["data"]["path"] = local_reference["data"]
    seen = []
    outcome = harness.run_job(cfg, controller="SlowRetention", inspect=lambda c: seen.extend(c.deletions_done()))
    assert outcome.error is None and outcome.committed == FINAL
    # Committing 8 deletes 4, committing 12 deletes 8; each deletion was released by the next commit.
    assert len(seen) == 2
    assert seen[0] == {"step": 4, "blocked_at_commit": 8, "released_at_commit": FINAL}
    assert seen[1] == {"step": 8, "blocked_at_commit": FINAL, "released_at_commit": FINAL}  # by the job's end
    kept = sorted(p.name for p in Path(cfg["checkpoint"]["save_path"]).iterdir() if p.name.startswith("iteration_"))
    assert kept == [f"iteration_{FINAL:08d}"]  # the job's end waited for its deletions
    assert shard_bytes(cfg["checkpoint"]["save_path"], FINAL) == shard_bytes(local_reference["root"], FINAL)


@pytest.mark.invariant(9)
def test_a_job_that_lost_its_lease_commits_nothing_more(tmp_path, local_reference):
    """Fencing: the lease taken over before iteration 8's commit; that commit writes no JSON and
    no tracker, the ranks stop, and the run ends naming the job that holds the lease now."""
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = local_reference["data"]
    root = Path(cfg["checkpoint"]["save_path"])
    outcome = harness.run_job(cfg, controller="StolenLease")
    assert "the commit of iteration 8 failed: this job" in outcome.error
    assert "no longer holds the writer lease" in outcome.error and "job thief took it over" in outcome.error
    assert tracker(root) == "4" and outcome.committed == 4
    assert not (root / "iteration_00000008" / paths.COMMON).exists()
    assert not (root / f"iteration_{FINAL:08d}").exists()  # the ranks stopped
    saved = {r["step"] for r in read_metrics(str(root)) if r.get("saved")}
    assert max(saved) == 8  # and saved nothing more into a root another job holds


def test_between_saves_rank_0_takes_the_newest_stop_answer_and_before_a_save_a_fresh_one():
    """On Ray, `should_stop` is asked in the background (the harness's controller answers at once,
    so the test above cannot tell): a step that may save, or whose newest answer says stop, waits
    for a fresh answer; the lease may have been lost since the newest one."""
    from ray_resume.calls import STOP_NOW
    from ray_resume.train_loop import should_stop

    class Poll:
        def __init__(self, newest, fresh):
            self.newest, self.fresh, self.waited = newest, fresh, 0

        def latest(self):
            return self.newest

        def now(self):
            self.waited += 1
            return self.fresh

    quiet = Poll(0, STOP_NOW)
    assert should_stop(quiet, may_save=False) == 0 and quiet.waited == 0  # no round trip between saves
    assert should_stop(quiet, may_save=True) == STOP_NOW and quiet.waited == 1
    stale = Poll(1, STOP_NOW)
    assert should_stop(stale, may_save=False) == STOP_NOW and stale.waited == 1


def marked_slow_loss(marks: str, step_sleep: float, model, batch):
    """The built-in loss (the same numbers), slower, leaving a file named by the pid that trains."""
    (Path(marks) / str(os.getpid())).touch()
    time.sleep(step_sleep)
    return next_token_loss(model, batch)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.invariant(1, 2, 3)
def test_a_rank_sigkilled_from_outside_at_a_random_moment(tmp_path, local_reference, seed):
    """Anywhere: mid-step, mid-write in the writer thread, mid-report to the controller."""
    rng = random.Random(seed)
    step_sleep = 0.03  # per micro-batch, 2 per step: the 12 steps take ~0.7 s
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = local_reference["data"]
    marks = tmp_path / "marks"
    marks.mkdir()
    outcome = {}
    job = threading.Thread(
        target=lambda: outcome.update(
            result=harness.run_job(cfg, loss=functools.partial(marked_slow_loss, str(marks), step_sleep))
        )
    )
    job.start()
    try:
        # Training has begun, and rank 0 has put its start on disk: a rank can take its first loss while
        # rank 0 still writes it (on a busy machine a kill of rank 0 then lost attempt 0's start record).
        while not any(marks.iterdir()) or not any(
            r.get("event") == "start" and r["rank"] == 0 for r in read_metrics(cfg["checkpoint"]["save_path"])
        ):
            assert job.is_alive(), outcome
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, (FINAL - 1) * 2 * step_sleep))
        victim = rng.choice(sorted(int(p.name) for p in marks.iterdir()))
        os.kill(victim, signal.SIGKILL)
    finally:
        job.join(timeout=120)
    result = outcome["result"]
    assert result.error is None and result.committed == FINAL and result.attempts == 2, result
    restarts = assert_same_as_reference(cfg["checkpoint"]["save_path"], local_reference)
    assert [r["attempt"] for r in restarts] == [0, 1]
    assert restarts[1]["step"] in (0, 4, 8, FINAL)


class NoticeFrom:
    """Ray Train's preemption notice, patched: none for the first `calls - 1` questions, then one."""

    def __init__(self, calls: int):
        self.calls, self.asked = calls, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked >= self.calls


@pytest.mark.invariant(2)
def test_a_preemption_notice_saves_at_once_and_training_goes_on(tmp_path, local_reference):
    """Asked every log_every (4) steps, the notice comes at the second question, step 8: every rank
    saves that step (off the save interval, 6) and goes on training on the node's remaining time,
    and saves for the notice once, not at each later question."""
    cfg = tiny_config(tmp_path, checkpoint={"save_interleaved_steps": 6})
    cfg["data"]["path"] = local_reference["data"]
    outcome = harness.run_job(cfg, preempted=NoticeFrom(2))
    assert outcome.error is None and outcome.committed == FINAL and outcome.attempts == 1
    root = cfg["checkpoint"]["save_path"]
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("iteration_")) == [
        "iteration_00000006",
        "iteration_00000008",
        "iteration_00000012",
    ]
    records = read_metrics(root)
    assert not [r for r in records if r.get("event") == "stop"]
    assert {r["step"] for r in records if r.get("saved")} == {6, 8, FINAL}
    assert shard_bytes(root, 8) == shard_bytes(local_reference["root"], 8)  # the state the run had at step 8


@pytest.mark.invariant(11)
def test_no_storage_secret_lands_in_a_checkpoint_or_beside_it(tmp_path, local_reference):
    """Credentials given in checkpoint.storage are redacted in every iteration's config.yaml (and so in
    exports of it); no file the job writes holds them."""
    secrets = STORAGE_SECRETS
    cfg = tiny_config(tmp_path, checkpoint={"storage": secrets})
    cfg["data"]["path"] = local_reference["data"]
    run_on_harness(cfg)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written)
    for path in written:
        data = path.read_bytes()
        assert not any(value.encode() in data for value in secrets.values()), path
    saved = yaml.safe_load(
        (Path(paths.iteration_dir(cfg["checkpoint"]["save_path"], FINAL)) / paths.CONFIG).read_text()
    )
    assert {saved["checkpoint"]["storage"][k] for k in secrets} == {"<redacted>"}


@pytest.mark.invariant(8)
def test_a_resave_on_fewer_ranks_leaves_no_file_of_the_larger_world(tmp_path, local_reference):
    """A 3-rank job dies while writing iteration 8; the next job resumes from 4 on 2 ranks and saves 8
    again. The 3-rank files of the first attempt must be gone before 8's commit lands: a committed
    iteration holds exactly the files its metadata.json lists."""
    sections = {"model": {"dropout": 0.0}, "training": {"global_batch_size": 24}}
    root = str(tmp_path / "ckpt")
    first = tiny_config(
        tmp_path,
        scaling={"num_workers": 3},
        failure={"max_failures": 0},
        checkpoint={"async_save": False},
        **sections,
    )
    first["data"]["path"] = local_reference["data"]
    assert (
        harness.run_job(first, fault={"phase": "before_report", "step": 8, "rank": 2}).error is not None
    )  # no restart allowed: the job fails
    iteration_8 = Path(paths.iteration_dir(root, 8))
    assert {p.name for p in iteration_8.iterdir()} >= {
        "ckpt-model-0000002-0000003.safetensors",
        "ckpt-opt-0000002-0000003.safetensors",
    }
    again = tiny_config(tmp_path, scaling={"num_workers": 2}, checkpoint={"load_path": root}, **sections)
    again["data"]["path"] = local_reference["data"]
    run_on_harness(again)
    assert starts(root)[-1]["step"] == 4
    storage = LocalStorage()
    for step in (8, FINAL):
        it = open_iteration(storage, root, step)
        check_no_extra_shards(storage, it)
        assert sorted(p.name for p in Path(it.path).glob("*.safetensors")) == sorted(it.files)


@pytest.mark.invariant(1, 4)
def test_a_failed_commit_ends_the_run_with_its_error_and_the_next_start_resumes(tmp_path, local_reference):
    """The tracker write of iteration 8 fails: the ranks stop at a step boundary after it (saving it),
    the job ends with the failure named, and a new start resumes from the last good commit. (The ranks
    learn of the failure in the background: on a loaded machine they may reach step 12 and commit it first.)"""
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    outcome = harness.run_job(cfg, fault={"phase": "commit_fails", "step": 8})
    assert outcome.error.startswith(
        "the commit of iteration 8 failed: [Errno 5] injected fault: the tracker write for iteration 8 failed"
    )
    assert f"the tracker of {root} stays on iteration {outcome.committed}" in outcome.error
    assert tracker(root) == str(outcome.committed) and outcome.attempts == 1
    stops = {r["step"] for r in read_metrics(root) if r.get("event") == "stop"}
    assert stops == {outcome.committed} or (outcome.committed == FINAL and not stops)  # the stop step saved, committed
    # Iteration 8's files and JSON were written, its tracker write failed: never committed, so cleared
    # once the stop step's commit is newer (found by the soak: it stayed, one more than save_max).
    assert not (Path(root) / "iteration_00000008").exists()
    run_on_harness({**cfg, "checkpoint": {**cfg["checkpoint"], "load_path": root}})
    assert starts(root)[-1]["step"] == outcome.committed
    assert shard_bytes(root, FINAL) == shard_bytes(local_reference["root"], FINAL)
