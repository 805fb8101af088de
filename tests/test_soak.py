"""The soak (benchmarks/soak.py), short, as CI runs it: every kind of fault at least once under a fixed
seed, every check holding. And the soak is a check that can fail: with the storage layer's fsyncs
removed, or a resumed data stream one step off, it fails and says what broke."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

from benchmarks.soak import INVARIANTS, KINDS


def soak(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--dir", str(tmp_path / "work"), "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.invariant(1, 2, 3, 4, 5, 9)
def test_a_short_seeded_soak_survives_every_kind_of_fault(tmp_path):
    """The soak at its CI size: `--cover` draws every kind of fault at least once, on local disk and on the S3
    server on loopback, every invariant checked after each submission. Not smaller: its rounds are the
    fewest that cover the 16 kinds (5 with this seed)."""
    proc, report = soak(tmp_path, "--cover", "--seed", "1")
    assert proc.returncode == 0 and report["failure"] is None, proc.stdout[-3000:]
    assert {kind for kind, row in report["by_kind"].items() if row["injected"]} == set(KINDS)
    assert 0 < report["rounds_on_s3"] < report["rounds"]  # on the S3 server on loopback and on local disk
    assert all(row["survived"] == row["injected"] for row in report["by_kind"].values())
    assert {name for name, count in report["checked"].items() if count} == set(INVARIANTS)
    assert "| power_cut | " in proc.stdout and "seed 1" in proc.stdout  # the report's table


@pytest.mark.invariant(1, 4)
def test_the_soak_fails_when_the_commit_is_not_fsynced(tmp_path):
    """The storage layer's fsyncs made no-ops in every process of the job: the first power cut after a
    commit loses it (a page cache is all that held it), and the soak says so."""
    # local disk only: on object storage an acknowledged PUT is kept, so a power cut there loses nothing to find
    proc, report = soak(
        tmp_path, "--kinds", "power_cut", "--mutate", "no_fsync", "--rounds", "5", "--seed", "2", "--local-only"
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert report["failure"].startswith(INVARIANTS["no_commit_lost"] + ": after a power cut"), report["failure"]
    assert "SOAK FAILED (seed 2" in proc.stdout


@pytest.mark.invariant(3)
def test_the_soak_fails_when_the_data_cursor_is_off_by_one(tmp_path):
    """A resumed stream starts one step ahead: the first resume from a commit after step 0 trains on other
    samples, and the soak finds an iteration, a loss or a step's samples that are not the reference's."""
    proc, report = soak(
        tmp_path, "--kinds", "rank_killed_after_step", "--mutate", "cursor_off_by_one", "--rounds", "5", "--seed", "3"
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert report["failure"].startswith((INVARIANTS["bytes"], INVARIANTS["losses"], INVARIANTS["final_samples"])), (
        report["failure"]
    )
