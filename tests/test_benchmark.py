"""The checkpoint benchmark runs in its small mode and reports every row. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, env_for_subprocess

from benchmarks.checkpoint import ROWS, TRAIN_ROWS


@pytest.mark.starts_ray
def test_small_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkpoint", "--small", "--out", str(out), "--dir", str(tmp_path / "work")],
        cwd=REPO, env=env_for_subprocess(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results["sizes"]) == ["tiny"]
    tiny = results["sizes"]["tiny"]
    for row in ROWS:
        assert tiny.get(row) is not None, f"row {row!r} missing"
    for row in TRAIN_ROWS:
        assert tiny["training"].get(row) is not None, f"training row {row!r} missing"
    # Bytes read per load are facts the loader's own tests pin (tests/test_load_balanced.py,
    # tests/test_elastic.py); here only that the benchmark reports them.
    assert tiny["load_balanced_bytes_read_vs_checkpoint"] > 0 and tiny["load_bytes_read_vs_checkpoint"] > 0
    assert "| ours async: stall (buffers reused) |" in proc.stdout
    assert not list((tmp_path / "work").iterdir())  # checkpoints of the benchmark are cleaned up


def test_restart_floor_times_the_imports_of_a_restarted_worker(tmp_path):
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.restart_floor", "--rounds", "1", "--out", str(out)],
                          cwd=REPO, env=env_for_subprocess(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["rows"]) == {f"{case}, {n} at once" for case in ("interpreter", "imports") for n in (1, 2)}
    assert "torch._dynamo" in results["imports"] and "| imports, 2 at once |" in proc.stdout
