"""Time to the first step and clean wall time: ours against a plain Ray Train script, no kills.

    python -m benchmarks.start                 # 400 steps each, ~3 min on 2 cores
    python -m benchmarks.start --rounds 2      # each contender twice, alternating

All run the same 2-worker job (the quickstart's GPT and data, global batch 32, DDP on CPU, a save
every 100 steps) on one Ray started here: ours through `ray_resume.train`, theirs the pattern Ray
Train's docs teach (`torch.save` + `ray.train.report(checkpoint=)`; benchmarks/goodput.py's loop,
whose batches come from the same `ray_resume.SampleStream`). Per run: the wall
time of the call, its parts (to the first step, the steps, after the last step), the first 10
steps' samples/s against the steady rate (the first progress window of the quickstart), and for
ours the start's parts as its summary prints them (the `started` record).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.goodput import BATCH, QUICKSTART, SETTLE, run

FIRST = 10  # steps in the first progress window


def _parts(began: float, wall_s: float, start: float, steps: list[dict]) -> dict:
    """Wall time split at the first and last step; the first window's rate against the steady one
    (the mean step after the first SETTLE). `start`: when the train_func said it began."""
    times = [r["time"] for r in sorted(steps, key=lambda r: r["step"])]
    step_s = statistics.mean(b - a for a, b in zip(times[SETTLE:], times[SETTLE + 1 :]))
    return {
        "wall_s": wall_s,
        "to_first_step_s": times[0] - began,
        "steps_s": times[-1] - times[0] + step_s,
        "after_last_step_s": began + wall_s - times[-1],
        "step_s": step_s,
        "first_window_samples_per_s": FIRST * BATCH / (times[FIRST - 1] - start),
        "steady_samples_per_s": BATCH / step_s,
    }


def run_ours(tmp: Path, steps: int, data: str) -> dict:
    """The built-in job (`ray_resume.train`, as `python -m ray_resume.run` runs it), a save every 100 steps."""
    from ray_resume.api import train
    from ray_resume.metrics import read_metrics

    cfg = {
        "name": "start",
        "model": QUICKSTART,
        "data": {"path": data, "synthetic": {"samples": 4096, "files": 4, "row_groups_per_file": 4}},
        "training": {"global_batch_size": BATCH, "micro_batch_size": BATCH // 2, "train_steps": steps, "log_every": 50},
        "scaling": {"num_workers": 2},
        "checkpoint": {"save_path": str(tmp / "ckpt"), "save_interleaved_steps": 100},
    }
    began = time.time()
    train(cfg)
    wall_s = time.time() - began
    records = read_metrics(str(tmp / "ckpt"))
    [started] = [r for r in records if r.get("event") == "started" and r["rank"] == 0]
    [start] = [r for r in records if r.get("event") == "start" and r["rank"] == 0]
    row = _parts(began, wall_s, start["time"], [r for r in records if r["rank"] == 0 and "loss" in r])
    row["start"] = {k: v for k, v in started.items() if k.endswith("_s") and k != "redo_s"}
    return row


def run_plain(tmp: Path, steps: int, data: str) -> dict:
    """Ray Train's own pattern (benchmarks/goodput.py's loop with its checkpointing), no kill."""
    began = time.time()
    measured = run(
        "Ray Train + torch.save", tmp, data, steps=steps, save_every=100, memory_every=0, sleep=0, kill_at=[]
    )
    records = [json.loads(line) for line in (tmp / "steps.jsonl").read_text().splitlines()]
    [start] = [r for r in records if r.get("event") == "start"]
    return _parts(began, measured["wall_s"], start["loaded"], [r for r in records if "event" not in r])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/start_results.json")
    args = parser.parse_args(argv)
    from ray_resume.config import SyntheticDataConfig
    from ray_resume.data import ensure_dataset
    from ray_resume.ray_backend import init_local_ray

    init_local_ray(num_cpus=4)
    contenders = {
        "Ray Train + torch.save": run_plain,
        "ours": run_ours,
    }
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        ensure_dataset(
            data,
            SyntheticDataConfig(samples=4096, files=4, row_groups_per_file=4),
            QUICKSTART["seq_len"],
            QUICKSTART["vocab_size"],
        )
        for _ in range(args.rounds):
            for name, runner in contenders.items():
                runs[name].append(runner(Path(tempfile.mkdtemp(dir=tmp)), args.steps, data))
                print(f"{name}: {json.dumps(runs[name][-1])}", flush=True)
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "start"} for name, rs in runs.items()}
    rows["ours"]["start"] = {
        k: statistics.median(r["start"].get(k, 0.0) for r in runs["ours"]) for k in runs["ours"][0]["start"]
    }
    theirs = rows["Ray Train + torch.save"]
    print(
        f"\n{args.steps} steps, medians of {args.rounds} run(s) each; ours / theirs wall time: "
        f"{rows['ours']['wall_s'] / theirs['wall_s']:.2f}x\n"
    )
    print("| contender | wall | to the first step | steps | after the last step | step | first 10 steps | steady |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['wall_s']:.1f} s | {r['to_first_step_s']:.1f} s | {r['steps_s']:.1f} s | {r['after_last_step_s']:.1f} s | "
            f"{r['step_s']:.4f} s | {r['first_window_samples_per_s']:.0f} samples/s | {r['steady_samples_per_s']:.0f} samples/s |"
        )
    from ray_resume.summary import START_PARTS

    start = rows["ours"]["start"]
    print(
        "\nours, the start: " + ", ".join(f"{label} {start[key]:.1f} s" for key, label in START_PARTS if key in start)
    )
    Path(args.out).write_text(
        json.dumps({"steps": args.steps, "rounds": args.rounds, "rows": rows, "runs": runs}, indent=1) + "\n"
    )
    return rows


if __name__ == "__main__":
    main()
