"""scripts/gpu_check.py, the check a GPU machine runs, dry-run on CPU with gloo: every part runs, the
exactness checks hold, and nothing it imports needs Ray (the device has none). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, env_for_subprocess


def test_the_gpu_check_runs_on_cpu_without_ray(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["backend"] == "gloo" and results["ray_imported"] is False
    shards = ["ckpt-model-0000000-0000001.safetensors", "ckpt-opt-0000000-0000001.safetensors"]
    for part in ("exact", "fsdp"):  # resumed in a fresh process: the same shard bytes and losses at step n
        r = results[part]
        assert r["equal"] and r["files"] == shards and r["differ"] == [], r
        assert r["losses_equal"] and sorted(r["resumed_losses"]) == [str(s) for s in range(r["k"] + 1, r["n"] + 1)]
    speed = results["speed"]
    assert speed["ours_load_equal"] and speed["ours_load_bytes_read"] == speed["checkpoint_bytes"]
    for key in (
        "dcp_save_s",
        "dcp_async_stall_s",
        "dcp_load_s",
        "ours_load_s",
        "ours_sync_save_vs_dcp_save",
        "ours_load_vs_dcp_load",
    ):
        assert speed[key] > 0, key
    assert "[gpu-check] every check held" in proc.stdout
