"""The Ray requirement is a range (pyproject.toml): its newest minor is the suite's own venv, its oldest
is proven here, in a venv of its own as a user on that Ray would have it (torch, then ray_resume with
Ray pinned to that minor), by a user's two ways in, each with a worker killed (tests/ray_range_check.py).

The venv is built once, in the background from the start of the session (conftest.py), beside the
other tests: `.venv-ray-<minor>` at the repository's root, reused by later runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FINAL, REPO, shard_bytes, tiny_config


def oldest_minor() -> str:
    """The lower bound of pyproject.toml's Ray requirement: "2.56" for `ray[...]>=2.56,<3`."""
    found = re.search(r'"ray\[[^\]]*\]>=(\d+\.\d+)[^"]*"', (REPO / "pyproject.toml").read_text())
    assert found, "pyproject.toml's Ray requirement has no lower bound"
    return found[1]


def venv_of(minor: str) -> Path:
    return REPO / f".venv-ray-{minor}"


def build_command(minor: str) -> list[str]:
    """Make the venv of `minor` unless it is there: under a lock, so that a second caller waits for the
    first's build and then finds it ready (the session's background build, then the test)."""
    venv = venv_of(minor)
    torch_first = "" if shutil.which("nvidia-smi") else f"{venv}/bin/python -m pip install -q torch==2.13.0 && "
    build = (
        f"[ -f {venv}/ready ] && exit 0; rm -rf {venv}; {sys.executable} -m venv {venv} && {torch_first}"
        f"{venv}/bin/python -m pip install -q 'ray[default,train,data]=={minor}.*' -e {REPO} && touch {venv}/ready"
    )
    return ["flock", f"{venv}.lock", "bash", "-c", build]


def start_building() -> subprocess.Popen:
    """Build the oldest minor's venv in the background (conftest.py, at the session's start), at idle CPU and
    disk priority: pip unpacks about 1.6 GB beside the first tests."""
    minor = oldest_minor()
    return subprocess.Popen(
        ["ionice", "-c", "3", *build_command(minor)] if shutil.which("ionice") else build_command(minor),
        stdout=open(REPO / f".venv-ray-{minor}.log", "w"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)),
        start_new_session=True,  # its own process group: ended whole if the run ends first
    )


def wait_for_venv(minor: str) -> Path:
    """The venv's python, once the build under way is done (or, with none, once this one is)."""
    done = subprocess.run(build_command(minor), capture_output=True, text=True, timeout=1200)
    log = REPO / f".venv-ray-{minor}.log"
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    return venv_of(minor) / "bin" / "python"


@pytest.mark.starts_ray
@pytest.mark.invariant(2, 15)
def test_the_oldest_admitted_ray_resumes_byte_identical_after_a_worker_is_killed(tmp_path, local_reference):
    """On the oldest Ray minor pyproject.toml admits: the built-in job with rank 1 SIGKILLed after step
    6 resumes from iteration 4 and ends with every shard of 4, 8 and 12 byte-identical to the suite's
    uninterrupted run, and `fit` with a user's own loop killed the same way resumes at 4 and commits 12.
    Not smaller: two jobs, each a worker group started and restarted by that Ray's own Ray Train, are what the
    range promises (the venv is built beside the first tests)."""
    minor = oldest_minor()
    python = wait_for_venv(minor)
    # A sync save: 4 is committed inside rank 1's report, before step 5's allreduce; the kill at 6 finds it.
    cfg = tiny_config(tmp_path, checkpoint={"async_save": False})
    cfg["data"]["path"] = local_reference["data"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "PYTHON"))}
    done = subprocess.run(
        [str(python), str(REPO / "tests" / "ray_range_check.py"), str(tmp_path), str(tmp_path / "config.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["ray"].startswith(f"{minor}.")
    assert said["built_in"] == {"starts": [0, 4]}
    for step in (4, 8, FINAL):
        assert shard_bytes(cfg["checkpoint"]["save_path"], step) == shard_bytes(local_reference["root"], step), step
    assert said["fit"] == {"starts": [0, 4], "committed": 12}
