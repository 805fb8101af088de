"""The whole job as users run it: `python -m ray_resume.run` in its own process.

These start their own Ray (a local one inside the driver, or a head node
started here for `ray job submit`), on loopback only, and end exactly the
processes they started. The driver-kill phases are also run, each with
its follow-up checks, on the in-process harness (tests/test_harness.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import (
    FINAL,
    REPO,
    SESSION_RAY,
    assert_same_as_reference,
    env_for_subprocess,
    read_metrics,
    run_on_harness,
    shard_bytes,
    tiny_config,
)
from ray_resume.checkpoint.format import paths


def write_config(tmp: Path, reference, **sections) -> Path:
    cfg = tiny_config(tmp, **sections)
    cfg["data"]["path"] = reference["data"]
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(args: list[str], join_session_ray: bool = False, **kw) -> subprocess.Popen:
    """A child in its own process group, so that it and everything it spawned can be ended together;
    a driver on the session's Ray with `join_session_ray` (the console test's starts its own)."""
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env_for_subprocess(join_session_ray),
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        end_group(proc)
    return proc.returncode, out


def end_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End what is left of the child's process group: SIGTERM, and SIGKILL after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once the whole group is gone
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tracker(root: str) -> str:
    return Path(paths.tracker_path(root)).read_text().strip()


@pytest.mark.invariant(1, 4, 9)
def test_driver_killed_between_json_and_tracker_then_restarted_with_load_path(tmp_path, reference):
    """The driver SIGKILLed between iteration 8's JSON and the tracker, then a new driver with load_path
    resumes from 4 and rewrites 8 byte for byte. Not smaller: two whole `python -m ray_resume.run`
    processes, since a driver's death and a new driver are what is proven."""
    config = write_config(tmp_path, reference)
    root = str(tmp_path / "ckpt")
    run = [sys.executable, "-m", "ray_resume.run", str(config)]
    code, out = finish(
        start([*run, "--fault", "phase=commit_before_tracker,step=8"], join_session_ray=True), timeout=300
    )
    assert code == -signal.SIGKILL, out[-3000:]
    # The JSON of iteration 8 is on disk, but the tracker never moved past 4.
    assert (Path(root) / "iteration_00000008" / "metadata.json").exists()
    assert tracker(root) == "4"

    code, out = finish(
        start(
            [*run, "--set", f"checkpoint.load_path={root}"],
            join_session_ray=True,
        ),
        timeout=300,
    )
    assert code == 0, out[-3000:]
    assert f"resumed from {root}/iteration_00000004" in out  # never the half-committed 8
    assert "global_step 4, consumed samples 64; continuing at step 5" in out
    # Worker lines reach the driver asynchronously: the last ones may be cut off at exit, not step 8's.
    assert "step 8/12 | loss " in out and "samples/s | last committed iteration " in out and "| ETA 0:" in out
    assert f"finished: last committed iteration {FINAL}" in out
    assert tracker(root) == str(FINAL)
    for step in (8, FINAL):  # 8 was written again and replaced cleanly
        assert shard_bytes(root, step) == shard_bytes(reference["root"], step)


def test_ray_job_submit_to_a_running_cluster(tmp_path, reference):
    """`ray job submit -- python -m ray_resume.run config.yaml` to the session's Ray through its dashboard's
    job API, as to any cluster's head (ray_resume installed there, no working_dir): the entrypoint runs
    with RAY_ADDRESS set, which joins that cluster."""
    config = write_config(tmp_path, reference, scaling={"num_workers": 1}, training={"micro_batch_size": 8})
    ray_cli = str(Path(sys.executable).parent / "ray")  # the venv's, whether or not it is activated
    submit = start(
        [
            ray_cli,
            "job",
            "submit",
            "--address",
            SESSION_RAY["dashboard"],
            "--",
            sys.executable,
            "-m",
            "ray_resume.run",
            str(config),
        ],
        cwd=REPO,
    )
    code, out = finish(submit, timeout=400)
    assert code == 0, out[-4000:]
    assert "succeeded" in out and f"finished: last committed iteration {FINAL}" in out, out[-4000:]
    root = str(tmp_path / "ckpt")
    assert tracker(root) == str(FINAL)
    assert len(shard_bytes(root, FINAL)) == 2  # one rank: its model and opt shards


def test_sigterm_to_the_driver_saves_commits_and_exits_143(tmp_path, reference):
    config = write_config(
        tmp_path, reference, training={"train_steps": 200, "log_every": 2}, checkpoint={"save_interleaved_steps": 1000}
    )
    root = str(tmp_path / "ckpt")
    driver = start([sys.executable, "-m", "ray_resume.run", str(config)], join_session_ray=True)
    lines: list[str] = []
    try:
        for line in driver.stdout:  # wait until training is under way, then preempt
            lines.append(line)
            if "| loss " in line:
                driver.send_signal(signal.SIGTERM)
                break
        code, rest = finish(driver, timeout=300)
    finally:
        end_group(driver)
    out = "".join(lines) + rest
    assert code == 143, out[-3000:]  # stopped to be resumed: neither finished (0) nor failed (1, 2)
    match = re.search(r"stopped at step (\d+) on request: committed iteration (\d+)", out)
    assert match and match.group(1) == match.group(2), out[-3000:]
    stopped = int(match.group(1))
    assert 0 < stopped < 200 and tracker(root) == str(stopped)
    common = json.loads((Path(paths.iteration_dir(root, stopped)) / "common.json").read_text())
    assert common["global_step"] == stopped and common["consumed_samples"] == 16 * stopped

    # What the stop committed resumes like any iteration (a driver's resume on Ray is the test above's
    # second run): two steps more on the harness.
    cfg = yaml.safe_load(config.read_text())
    cfg["training"]["train_steps"], cfg["checkpoint"]["load_path"] = stopped + 2, root
    run_on_harness(cfg)
    again = [r for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0][-1]
    assert (again["step"], again["consumed_samples"]) == (stopped, 16 * stopped), again
    assert again["source"].endswith(f"iteration_{stopped:08d}"), again
    assert tracker(root) == str(stopped + 2)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.invariant(2, 3)
def test_the_console_of_a_run_that_loses_a_worker(tmp_path, reference):
    """`python -m ray_resume.run` with rank 1 killed after its optimizer step 6, a progress line every
    step: each line once, no blank worker lines, no Ray tracebacks for the recovered failure, the
    recovery in one line of ours, a summary, and the whole console within 3x the progress lines + 40.
    Saves are synchronous, so iteration 4 is certainly committed before step 5's all-reduce and the
    group resumes from it, by itself, to end with the uninterrupted run's bytes.
    Not smaller: the console is a whole run's, with its restart."""
    config = write_config(
        tmp_path,
        reference,
        training={"log_every": 1},
        checkpoint={"async_save": False},
    )
    kill = "phase=after_optimizer_step,step=6,rank=1"
    code, out = finish(start([sys.executable, "-m", "ray_resume.run", str(config), "--fault", kill]), timeout=300)
    assert code == 0, out[-3000:]
    lines = [ANSI.sub("", line) for line in out.splitlines()]
    progress = [line for line in lines if re.search(r"\[tiny\] step \d+/12 \|", line)]
    [lost] = [line for line in lines if "worker group lost after step" in line]
    reached = int(re.search(r"after step (\d+)", lost).group(1))
    assert "(attempt 0; rank 1: " in lost  # Ray Train's account of the failed rank, its first line
    assert f"); resuming from iteration 4: {reached - 4} steps to redo" in lost
    for step in range(1, FINAL + 1):  # once, or twice when redone; the run's last lines may be cut off at exit
        count = sum(f"step {step}/12 |" in line for line in progress)
        assert count <= (2 if 4 < step <= reached else 1), (step, progress)
        assert count >= 1 or step > 8, (step, progress)
    assert not [line for line in lines if re.fullmatch(r"\(\w+ pid=\d+(, ip=[\d.]+)?\)\s*", line)]  # blank worker lines
    for noise in (
        "Traceback",
        "Failed to query Ray Train Controller actor state",
        "multiple active Ray",
        "Starting execution of Dataset",
        "[FailurePolicy]",
        "Attempting to start training worker group",
    ):
        assert noise not in out, noise
    assert any(f"{FINAL} steps (1-{FINAL}) in " in line for line in lines)
    [began] = [line for line in lines if "s to the end of the first step (" in line]  # the start, part by part
    assert all(
        re.search(rf"[(,] ?{part} \d+\.\d s", began)
        for part in (
            "checks",
            "Ray",
            "our actors",
            "new processes",
            "imports and setup",
            "build and restore",
            "first batch",
            "first step",
        )
    ), began
    assert re.search(r"first step \d+\.\d s\)$", began), began
    assert any(f"1 restart: after step {reached}: resumed from 4" in line for line in lines)
    assert len(lines) <= 3 * len(progress) + 40, "\n".join(lines)
    root = str(tmp_path / "ckpt")
    assert_same_as_reference(root, reference)
    restarts = [r for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0]
    assert [r["step"] for r in restarts] == [0, 4] and restarts[1]["source"].endswith("iteration_00000004"), restarts
