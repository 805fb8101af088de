"""Invariant 15 on a real `fit()`: a rank forked from the fork server is the process Ray would have
started. scripts/fork_parity.py runs the same 2-rank job, which loses rank 1 once, with
`failure.fork_server` on and off, and compares what each rank of each group observes (its random
state, thread pools, environment, paths, arguments, limits, signals, cgroup, ...), whose `atexit`
handlers ran, which spawned processes outlived their rank, and the committed bytes."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import fork_parity  # noqa: E402


@pytest.mark.invariant(15)
@pytest.mark.usefixtures("ray_cluster")
def test_a_forked_rank_is_the_process_ray_would_have_started(tmp_path):
    runs = {name: fork_parity.run(tmp_path / name, fork_server=name == "on") for name in ("off", "on")}
    assert sorted(runs["on"]["starts"]) == ["first-0", "first-1", "restarted-0", "restarted-1"]
    # The servers forked these: the ranks' parents are one process (Ray's raylet off, the server on).
    parents = {name: {f["parent"] for f in run["starts"].values()} for name, run in runs.items()}
    assert len(parents["on"]) == 1 and parents["on"] != parents["off"], parents
    # Facts compared per rank start: its own, less pid, parent and spawned pid, plus atexit, outlived, bytes.
    assert len(runs["off"]["starts"]["first-0"]) >= 15
    # The one fact a fork cannot have anew: CPython draws the hash seed of str and bytes once per
    # interpreter (docs/restarts.md says so); every other one is the same on as off.
    assert fork_parity.differences(runs["on"], runs["off"]) == [
        "str_hash: distinct across rank starts on False, off True"
    ]
    assert {f["torch_threads"] for f in runs["on"]["starts"].values()} == {1}  # resources_per_worker CPU: 1
