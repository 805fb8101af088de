"""The checkpoint benchmark runs in its small mode and reports every row. No timing is asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, env_for_subprocess

from benchmarks.checkpoint import ROWS, _config
from benchmarks.throughput import CONTENDERS
from ray_resume.config import Config
from ray_resume.model import build_model


def run_benchmark(
    module: str, *args: str, timeout: int = 300, on_session_ray: bool = False
) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m benchmarks.MODULE ARGS --out OUT` (OUT the last argument's file), as a reader runs it:
    what it printed, and the results it wrote."""
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=REPO,
        env=env_for_subprocess(join_session_ray=on_session_ray),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(Path(args[args.index("--out") + 1]).read_text())


@pytest.mark.usefixtures("ray_cluster")
def test_small_benchmark_writes_every_row(tmp_path):
    """`benchmarks/checkpoint.py --small` on the session's Ray, as a reader runs it: every row of the
    checkpoint table measured once at the tiny size. Not smaller: each row is one contender's save or load,
    and every one is checked."""
    out = tmp_path / "results.json"
    proc, results = run_benchmark(  # on the session's Ray (RAY_ADDRESS), as on a cluster's
        "checkpoint", "--small", "--out", str(out), "--dir", str(tmp_path / "work"), on_session_ray=True
    )
    assert list(results["sizes"]) == ["tiny"]
    tiny = results["sizes"]["tiny"]
    for row in ROWS:
        assert tiny.get(row) is not None, f"row {row!r} missing"
    # What was measured is what the rows say. The model is the tiny GPT, and its checkpoint holds
    # it and AdamW's two moments in float32 (plus a 0-d step per parameter and the headers).
    model = build_model(Config.from_dict(_config(str(tmp_path), "tiny")).model)
    params = sum(p.numel() for p in model.parameters())
    assert tiny["params"] == params
    assert 3 * 4 * params < tiny["checkpoint_bytes"] < 3 * 4 * params + (64 << 10)
    assert all(tiny[row] > 0 for row in ROWS if row.endswith("_s"))
    # Every ratio is the ratio of its own two rows (a row computed from the wrong pair fails here).
    for ratio, (a, b) in {
        "ours_vs_raw": ("ours_save_gbps", "raw_write_gbps"),
        "ours_save_vs_dcp_save": ("ours_sync_save_s", "dcp_save_s"),
        "ours_load_vs_torch_load": ("ours_load_s", "torch_load_s"),
        "load_bytes_read_vs_checkpoint": ("ours_load_bytes_read", "checkpoint_bytes"),
        "load_balanced_bytes_read_vs_checkpoint": ("ours_load_balanced_bytes_read", "checkpoint_bytes"),
    }.items():
        assert tiny[ratio] == pytest.approx(tiny[a] / tiny[b], rel=1e-3, abs=1e-4), ratio
    # Bytes, not timings: each of the 2 ranks reads the whole replicated checkpoint directly, and with
    # load_balanced each byte once (the JSON files and the verifiers' headers are the few percent over).
    assert 1.9 <= tiny["load_bytes_read_vs_checkpoint"] <= 2.1
    assert 0.95 <= tiny["load_balanced_bytes_read_vs_checkpoint"] <= 1.1
    assert len(tiny["ours_vs_raw_pairs"]) == 2
    assert tiny["ours_vs_raw_paired"] == pytest.approx(sum(tiny["ours_vs_raw_pairs"]) / 2, abs=1e-4)  # the median of 2
    # The console table shows the JSON's numbers.
    assert (
        f"| load, load_balanced (bytes read / ckpt) | {tiny['ours_load_balanced_s']:.3f} s "
        f"({tiny['load_balanced_bytes_read_vs_checkpoint']:.2f}x) |" in proc.stdout
    )
    assert "| ours async: stall (buffers reused) |" in proc.stdout
    assert not list((tmp_path / "work").iterdir())  # checkpoints of the benchmark are cleaned up


def tiny_throughput(tmp_path: Path, args: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """`benchmarks/throughput.py --sizes tiny ARGS` on the session's Ray: what it printed, its tiny results."""
    out, work = str(tmp_path / "throughput.json"), str(tmp_path / "work")
    proc, results = run_benchmark(
        "throughput",
        "--sizes",
        "tiny",
        *args.split(),
        "--dir",
        work,
        "--out",
        out,
        timeout=timeout,
        on_session_ray=True,
    )
    return proc, results["sizes"]["tiny"]


@pytest.mark.usefixtures("ray_cluster")
def test_throughput_runs_every_contender_and_reports_its_own_ratios(tmp_path):
    """`benchmarks/throughput.py` at the tiny size: every contender once, each beside a run without saves (14
    short runs on one pair of actors). Not smaller: a contender left out would leave its row of the table
    unproven."""
    proc, tiny = tiny_throughput(tmp_path, "--rounds 1 --cycles 1 --intervals 3", 600)  # every contender
    # Every contender (ours each committed every save, or the run would have failed).
    assert set(tiny["contenders"]) == {f"{mode}@3" for mode in CONTENDERS}
    for key, c in tiny["contenders"].items():
        # One round: the ratio is its rate over the run beside it without saves; the spread, that one value.
        # (to its 4 decimals: 0.0078 for 0.007757 on a loaded machine failed the relative bound alone)
        ratio = c["steps_per_s"] / c["beside_never_steps_per_s"]
        assert c["vs_never"] == pytest.approx(ratio, rel=2e-3, abs=5e-5), key
        assert c["vs_never_spread"] == [c["vs_never"], c["vs_never"]], key
        assert c["stall_s"] > 0, key
        # the CPU a save of ours costs a rank (none measured for DCP's): one round's, so its spread is itself
        if not key.startswith("dcp"):
            assert c["save_cpu_s"] > 0 and c["save_cpu_spread"] == [c["save_cpu_s"], c["save_cpu_s"]], key
        else:
            assert c["save_cpu_s"] is None, key
    row = tiny["contenders"]["async_process@3"]
    assert f"| async_process | {row['vs_never']:.3f}x [{row['vs_never']:.3f}, {row['vs_never']:.3f}] |" in proc.stdout
    cpu = row["save_cpu_s"]
    assert f" {cpu:.3f} s [{cpu:.3f}, {cpu:.3f}] |" in proc.stdout
    assert not list((tmp_path / "work").iterdir())  # every run's checkpoints are cleaned up


@pytest.mark.usefixtures("ray_cluster")
def test_throughput_pairs_each_save_with_the_clean_steps_after_it(tmp_path):
    """`--baseline cycles`: no runs without saves; each save after the first gives a pair (the k steps
    from it, the k clean steps after them), and the figure is the median of clean / with over the pairs."""
    args = "--rounds 1 --cycles 2 --intervals 3 --contenders sync,async_process --baseline cycles"
    proc, tiny = tiny_throughput(tmp_path, args, 300)
    assert tiny["baseline"] == "cycles" and tiny["never_steps_per_s"] is None
    assert " never " not in proc.stdout  # no run without saves
    assert set(tiny["contenders"]) == {"sync@3", "async_process@3"}
    for key, c in tiny["contenders"].items():
        assert len(c["pairs"]) == 2 and 0 <= c["spilled"] <= 2, key  # --cycles pairs a run, a round
        ratios = [clean / with_save for clean, with_save in c["pairs"]]
        assert c["vs_never"] == pytest.approx(statistics.median(ratios), rel=2e-3, abs=5e-5), key
        assert c["vs_never_spread"] == pytest.approx([min(ratios), max(ratios)], rel=2e-3, abs=5e-5), key
    assert "the k steps from each save against the k clean steps after them" in proc.stdout


def test_restart_floor_times_the_imports_of_a_restarted_worker(tmp_path):
    out = tmp_path / "floor.json"
    proc, results = run_benchmark("restart_floor", "--rounds", "1", "--out", str(out))
    assert set(results["rows"]) == {f"{case}, {n} at once" for case in ("interpreter", "imports") for n in (1, 2)}
    rows = results["rows"]
    assert all(0 < row["min_s"] <= row["median_s"] <= row["max_s"] for row in rows.values()), rows
    for n in (1, 2):  # importing what a rank imports takes longer than starting an interpreter that imports nothing
        assert rows[f"imports, {n} at once"]["min_s"] > rows[f"interpreter, {n} at once"]["max_s"], rows
    assert f"| imports, 2 at once | {rows['imports, 2 at once']['median_s']:.2f} |" in proc.stdout


def test_dcp_reads_loads_every_layout_and_counts_what_each_rank_read(tmp_path):
    """`benchmarks/dcp_reads.py --size small`: every load of the table runs, one count per rank; a load
    on the saving layout or on one rank reads each byte of ours once (no timing).
    Not smaller: every load of the table is a real DCP load, each one checked."""
    out = tmp_path / "reads.json"
    proc, results = run_benchmark("dcp_reads", "--size", "small", "--out", str(out))
    rows = {(r["checkpoint"], r["loaded as"]): r for r in results["loads"]}
    assert [len(r["bytes read"]) for r in results["loads"]] == [1, 2, 3, 2, 3]
    assert rows[("ours", "plain, 1 rank")]["ratio"] == 1.0 and rows[("ours", "ddp, 2 ranks")]["ratio"] == 2.0


def test_save_cpu_times_the_copy_and_the_write_both_ways(tmp_path):
    """Past the page cache and through it, each with its copy alone, its copy and hash, its write and node
    CPU, in that order in the table; nothing left behind."""
    out = tmp_path / "save_cpu.json"
    proc, results = run_benchmark(
        "save_cpu", "--size", "tiny", "--rounds", "2", "--out", str(out), "--dir", str(tmp_path / "work")
    )
    ways = results["result"]["ways"]
    assert list(ways) == ["past the page cache", "through the page cache"]
    for way, w in ways.items():
        assert w["copy_cpu_s"] > 0 and w["copy_hash_cpu_s"] > 0 and w["write_cpu_s"] > 0 and w["write_wall_s"] > 0, way
        cells = (w["copy_cpu_s"], w["copy_hash_cpu_s"], w["write_cpu_s"])
        assert f"| {way} | " + "".join(f"{c:.3f} s | " for c in cells) in proc.stdout
    assert results["result"]["share_bytes"] > 0
    assert not list((tmp_path / "work").iterdir())
