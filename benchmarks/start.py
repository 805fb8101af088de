"""Time to the first step and clean wall time: ours, with the fork server and without, against a plain
Ray Train script, no kills.

    python -m benchmarks.start                 # 400 steps each, ~3 min on 2 cores
    python -m benchmarks.start --rounds 2      # each contender twice, alternating

All run the same 2-worker job (the quickstart's GPT and data, global batch 32, DDP on CPU, a save
every 100 steps) on one Ray started here: ours through `ray_resume.train`, theirs the pattern Ray
Train's docs teach (`torch.save` + `ray.train.report(checkpoint=)`; benchmarks/goodput.py's
`plain_train_func`, whose batches come from the same `ray_resume.SampleStream`). Per run: the wall
time of the call, its parts (to the first step, the steps, after the last step), the first 10
steps' samples/s against the steady rate (the first progress window of the quickstart), and for
ours the start's parts as its summary prints them (the `started` record).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.goodput import BATCH, QUICKSTART, ours, plain

FIRST = 10  # steps in the first progress window


def _parts(run: dict, steps: list[dict]) -> dict:
    """Wall time split at the first and last step; the first window's rate against the steady one."""
    times = sorted(r["time"] for r in steps)
    return {
        "wall_s": run["wall_s"],
        "to_first_step_s": run["startup_s"],
        "steps_s": times[-1] - times[0] + run["step_s"],
        "after_last_step_s": run["began"] + run["wall_s"] - times[-1],
        "step_s": run["step_s"],
        "first_window_samples_per_s": FIRST
        * BATCH
        / (times[FIRST - 1] - times[0] + run["step_s"] + run["first_gap_s"]),
        "steady_samples_per_s": BATCH / run["step_s"],
    }


def run_ours(tmp: Path, steps: int, data: str, fork_server: bool = True) -> dict:
    from ray_resume.metrics import read_metrics

    run = ours(tmp, steps, 100, 0, None, data, fork_server=fork_server)
    records = read_metrics(str(tmp / "ours-0"))
    [started] = [r for r in records if r.get("event") == "started" and r["rank"] == 0]
    [start] = [r for r in records if r.get("event") == "start" and r["rank"] == 0]
    steps_run = [r for r in records if r["rank"] == 0 and "loss" in r]
    # the window opens at the start record
    run["first_gap_s"] = min(r["time"] for r in steps_run) - run["step_s"] - start["time"]
    row = _parts(run, steps_run)
    row["start"] = {k: v for k, v in started.items() if k.endswith("_s") and k != "redo_s"}
    return row


def run_plain(tmp: Path, steps: int, data: str) -> dict:
    run = plain(tmp, steps, 100, None, data)
    records = [json.loads(line) for line in (tmp / "plain.jsonl").read_text().splitlines()]
    [start] = [r for r in records if r.get("event") == "start"]
    steps_run = [r for r in records if "step" in r and "event" not in r]
    run["first_gap_s"] = min(r["time"] for r in steps_run) - run["step_s"] - start["loaded"]
    return _parts(run, steps_run)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/start_results.json")
    args = parser.parse_args(argv)
    from ray_resume.config import SyntheticDataConfig
    from ray_resume.data import ensure_dataset
    from ray_resume.driver import init_local_ray

    init_local_ray(num_cpus=4)
    contenders = {
        "Ray Train + torch.save": run_plain,
        "ours": run_ours,
        "ours, fork server off": lambda *a: run_ours(*a, fork_server=False),
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
    for name in ("ours", "ours, fork server off"):
        rows[name]["start"] = {
            k: statistics.median(r["start"].get(k, 0.0) for r in runs[name]) for k in runs[name][0]["start"]
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

    for name in ("ours", "ours, fork server off"):
        print(
            f"\n{name}, the start: "
            + ", ".join(
                f"{label} {rows[name]['start'][key]:.1f} s" for key, label in START_PARTS if key in rows[name]["start"]
            )
        )
    print(
        f"fork server on / off, to the first step: "
        f"{rows['ours']['to_first_step_s'] / rows['ours, fork server off']['to_first_step_s']:.2f}x"
    )
    Path(args.out).write_text(
        json.dumps({"steps": args.steps, "rounds": args.rounds, "rows": rows, "runs": runs}, indent=1) + "\n"
    )
    return rows


if __name__ == "__main__":
    main()
