"""Goodput under failures: the same job with a training worker SIGKILLed every `--every` seconds.

    python -m benchmarks.goodput                 # 3 kills 30 s apart and 3 kills 120 s apart per contender, ~40 min
    python -m benchmarks.goodput --every 30      # one interval

Three contenders (four with `--without-fork-server`) on the same 2-worker job (the quickstart's GPT and data, global batch 32, DDP on CPU):

* ours with the memory tier: durable saves every `--save-every` steps, snapshots every
  `--memory-every` (20: Young's interval for a snapshot's cost here and a failure every 30 s);
* ours with durable saves only;
* with `--without-fork-server`, ours with the memory tier and `failure.fork_server: false` (the
  other two start the restarted ranks from the fork server, by its default);
* Ray Train without us: the pattern its docs teach, a `torch.save` of the model and optimizer
  every `--save-every` steps handed to `ray.train.report(checkpoint=...)`, and
  `ray.train.get_checkpoint()` + `torch.load` on a restart; its batches come from the same
  `ray_resume.SampleStream`, restarted at the checkpoint's step, so only checkpointing differs.

First the restart floor (benchmarks/restart_floor.py: two fresh interpreters importing what a rank
imports, at once), then each contender runs 800 steps without a kill (its steady step time, shown
for reference and to size the runs). Then, per interval, a killer thread SIGKILLs a live `RayTrainWorker` every `--every`
seconds from the first step on, `--kills` times, in a run long enough for them (the same steps
for every contender). A run's steady step time is the mean of its steps after each group's first
200 (saves included), measured in that run: this machine's speed drifts over minutes by more than
the failures cost. Effective training time ratio (ETTR) = steps x the steady step time / the wall
time of `fit()`. The time lost per failure is (wall - the run's own startup, fit() to its first
step - steps x the steady step time) / failures: the restarts, the redone steps and each new
group's slower first steps. Each failure on its own: "back
in", from the last step finished before the kill to the moment that step is finished again (its
mean, min and max over the failures), and its parts from the contender's own timestamps: restart
(from the kill to the new group's train function; for ours, Ray Train noticing it and the new
group, and of that the new processes' imports and setup), reload (to the resumed state) and redone
steps (the steps run again, at the steady step time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

QUICKSTART = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layers": 2, "n_heads": 4}
BATCH = 32
CLEAN_STEPS = 800
SETTLE = 200  # steps of each group's start left out of the steady step time (see _measured)


def live_workers() -> list[int]:
    return sorted(
        a["Pid"]
        for a in ray._private.state.actors(actor_state_name="ALIVE").values()
        if a["ActorClassName"] == "RayTrainWorker" and a["Pid"]
    )


class Killer(threading.Thread):
    """SIGKILLs one live training worker every `every` seconds, `times` times, once `started()` is true."""

    times = 3  # --kills

    def __init__(self, every: float | None, started):
        super().__init__(daemon=True)
        self.every, self.started, self.kills, self.done = every, started, [], threading.Event()
        if every:  # None: a clean run
            self.start()

    def run(self) -> None:
        while not self.done.is_set() and not self.started():
            time.sleep(0.2)
        while len(self.kills) < self.times and not self.done.wait(self.every):
            pids = live_workers()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                self.kills.append(time.time())


def ours(
    tmp: Path,
    steps: int,
    save_every: int,
    memory_every: int,
    every: float | None,
    data: str,
    fork_server: bool | str = "auto",
) -> dict:
    import ray.train

    from ray_resume.api import train
    from ray_resume.config import Config
    from ray_resume.driver import RayTrain
    from ray_resume.metrics import read_metrics

    root = tmp / f"ours-{memory_every}"
    cfg = Config.from_dict(
        {
            "name": f"goodput-{memory_every}",
            "model": QUICKSTART,
            "data": {"path": data, "synthetic": {"samples": 4096, "files": 4, "row_groups_per_file": 4}},
            "training": {
                "global_batch_size": BATCH,
                "micro_batch_size": BATCH // 2,
                "train_steps": steps,
                "log_every": 50,
            },
            "scaling": {"num_workers": 2},
            "failure": {"max_failures": -1, "fork_server": fork_server},
            "checkpoint": {
                "save_path": str(root),
                "save_interleaved_steps": save_every,
                "memory_interleaved_steps": memory_every,
            },
        }
    )
    killer = Killer(every, lambda: any(root.parent.glob(f"{root.name}-metrics/*.jsonl")))
    began = time.time()
    # Every run in a runtime env of its own: it starts its own fork server, as a new job does (this
    # driver's runs are one Ray job, whose server would otherwise serve them all from the first).
    train(
        cfg,
        backend=RayTrain(run_config=ray.train.RunConfig(worker_runtime_env={"env_vars": {"GOODPUT_RUN": str(root)}})),
    )
    killer.done.set()
    records = read_metrics(str(root))
    steps_run = [r for r in records if r.get("rank") == 0 and "loss" in r]
    restarts = [r for r in records if r.get("event") == "restart"]
    return _measured(
        began,
        time.time(),
        steps_run,
        killer.kills,
        [
            {
                "restart": sum(r.get(k, 0) for k in ("detect_s", "new_group_s", "spawn_s", "setup_s")),
                "setup": r.get("setup_s"),
                "reload": r["restore_s"],
                "redone": r["caught_up"] - r["step"],
            }
            for r in restarts
        ],
    )


def plain_train_func(config: dict) -> None:
    """What a Ray Train user writes without ray_resume (its docs' checkpointing pattern)."""
    import ray.train
    import ray.train.torch
    import torch

    from ray_resume import SampleStream
    from ray_resume.data import quiet_ray_data
    from ray_resume.model import GPT

    quiet_ray_data()  # no progress bars, as in ours

    entered = time.time()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(GPT(**QUICKSTART, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    batches = iter(SampleStream(config["data"], 1234, True, BATCH, rank, world, start * BATCH))
    log = open(config["log"], "a")
    if rank == 0:
        log.write(json.dumps({"event": "start", "entered": entered, "loaded": time.time(), "step": start}) + "\n")
    for step in range(start + 1, config["steps"] + 1):
        tokens = torch.as_tensor(next(batches)["input_ids"]).long()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % config["save_every"] == 0 or step == config["steps"]:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(
                        {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                        os.path.join(d, "state.pt"),
                    )
                ray.train.report(
                    {"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None
                )
        if rank == 0:
            log.write(json.dumps({"step": step, "time": time.time()}) + "\n")
            log.flush()


def plain(tmp: Path, steps: int, save_every: int, every: float | None, data: str) -> dict:
    from ray.train.torch import TorchTrainer

    log = tmp / "plain.jsonl"
    killer = Killer(every, lambda: log.exists() and log.stat().st_size > 0)
    trainer = TorchTrainer(
        plain_train_func,
        train_loop_config={"steps": steps, "save_every": save_every, "log": str(log), "data": data},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name=f"plain-{time.time_ns()}",
            storage_path=str(tmp / "plain"),
            failure_config=ray.train.FailureConfig(max_failures=-1),
        ),
    )
    began = time.time()
    trainer.fit()
    killer.done.set()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    attempt, steps_run, losses, reached = -1, [], [], 0
    for r in records:
        if r.get("event") == "start":
            attempt += 1
            if reached:
                losses.append(
                    {
                        "restart": r["entered"]
                        - max([k for k in killer.kills if k < r["entered"]], default=r["entered"]),
                        "reload": r["loaded"] - r["entered"],
                        "redone": reached - r["step"],
                    }
                )
        else:
            steps_run.append({**r, "attempt": attempt})
            reached = r["step"]
    return _measured(began, time.time(), steps_run, killer.kills, losses)


def _measured(began: float, ended: float, steps_run: list[dict], kills: list[float], losses: list[dict]) -> dict:
    """A run's wall time, startup (to its first step), steady step time, and failures. The steady step
    time is the mean of the steps that each group took after its first SETTLE (saves included): a
    group's start (its first batches, the fork server's imports beside its steps) is left to
    the run's startup and to the failure that caused it. `attempt_step_s`: the same per group."""
    steps_run = sorted(steps_run, key=lambda r: r["time"])
    first = {}
    for r in steps_run:
        first.setdefault(r["attempt"], r["step"])
    gaps: dict[int, list[float]] = {}
    for settle in (SETTLE, 0):  # a run whose groups all ran fewer than SETTLE steps: every step
        for a, b in zip(steps_run, steps_run[1:]):
            if (
                b["step"] == a["step"] + 1
                and b["attempt"] == a["attempt"]
                and a["step"] - first[a["attempt"]] >= settle
            ):
                gaps.setdefault(a["attempt"], []).append(b["time"] - a["time"])
        if gaps:
            break
    return {
        "began": began,
        "wall_s": ended - began,
        "startup_s": steps_run[0]["time"] - began,
        "step_s": statistics.mean(g for group in gaps.values() for g in group),
        "attempt_step_s": [round(statistics.mean(group), 4) for _, group in sorted(gaps.items())],
        "kills": len(kills),
        "losses": losses,
        "back_in": _back_in(steps_run, kills),
    }


def _back_in(steps_run: list[dict], kills: list[float]) -> list[float]:
    """Per kill: from the last step finished before it to that step finished again (or a later one)."""
    out = []
    for kill in kills:
        before = [r for r in steps_run if r["time"] < kill]
        if before:
            again = [r["time"] for r in steps_run if r["time"] > kill and r["step"] >= before[-1]["step"]]
            if again:
                out.append(min(again) - before[-1]["time"])
    return out


def _row(steps: int, run: dict, clean: dict) -> dict:
    """ETTR and the time lost per failure: the run's wall time less its own startup and its steps at
    its own steady step time (measured in the same run: this machine's speed drifts by more than
    the failures cost over minutes, so a clean run's step time is shown beside it, not used)."""
    step_s, losses = run["step_s"], run["losses"]
    part = lambda key: statistics.mean([x[key] for x in losses if x.get(key) is not None] or [0.0])
    lost, back = run["wall_s"] - run["startup_s"] - steps * step_s, run["back_in"] or [0.0]
    return {
        "steps": steps,
        "wall_s": round(run["wall_s"], 1),
        "kills": run["kills"],
        "failures": len(losses),
        "back_in_s": round(statistics.mean(back), 1),
        "back_in_min_s": round(min(back), 1),
        "back_in_max_s": round(max(back), 1),
        "setup_s": round(part("setup"), 1) if any(x.get("setup") is not None for x in losses) else None,
        "startup_s": round(run["startup_s"], 1),
        "step_s": round(step_s, 4),
        "clean_step_s": round(clean["step_s"], 4),
        "attempt_step_s": run["attempt_step_s"],
        "ettr": round(steps * step_s / run["wall_s"], 3),
        "lost_per_failure_s": round(lost / max(1, len(losses)), 1),
        "restart_s": round(part("restart"), 1),
        "reload_s": round(part("reload"), 2),
        "redone_s": round(part("redone") * step_s, 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, nargs="+", default=[30, 120], help="seconds between kills")
    parser.add_argument("--kills", type=int, default=3, help="kills per run")
    parser.add_argument(
        "--steps", type=int, default=0, help="steps per run with kills (default: enough for --kills + 1/2 intervals)"
    )
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--memory-every", type=int, default=20)
    parser.add_argument(
        "--without-fork-server",
        action="store_true",
        help="a fourth contender: the memory tier with failure.fork_server false (restarted ranks in new processes)",
    )
    parser.add_argument("--out", default="benchmarks/goodput_results.json")
    args = parser.parse_args(argv)
    from ray_resume.config import SyntheticDataConfig
    from ray_resume.data import ensure_dataset
    from ray_resume.driver import init_local_ray

    from benchmarks.restart_floor import CASES, timed

    floor = statistics.median(timed(CASES["imports"], 2) for _ in range(3))
    print(
        f"restart floor: {floor:.2f} s for 2 fresh interpreters importing a rank's modules at once (median of 3)",
        flush=True,
    )
    Killer.times = args.kills
    init_local_ray(num_cpus=4)
    results = {"restart_floor_s": round(floor, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        # Written once, before any run is timed (the first would count it as its startup).
        ensure_dataset(
            data,
            SyntheticDataConfig(samples=4096, files=4, row_groups_per_file=4),
            QUICKSTART["seq_len"],
            QUICKSTART["vocab_size"],
        )
        contenders = {
            "ours, memory tier": lambda t, n, every: ours(t, n, args.save_every, args.memory_every, every, data),
            "ours, durable only": lambda t, n, every: ours(t, n, args.save_every, 0, every, data),
            "Ray Train + torch.save": lambda t, n, every: plain(t, n, args.save_every, every, data),
        }
        if args.without_fork_server:
            contenders["ours, memory tier, no fork server"] = lambda t, n, every: ours(
                t, n, args.save_every, args.memory_every, every, data, False
            )
        clean = {}
        for name, runner in contenders.items():
            clean[name] = runner(Path(tempfile.mkdtemp(dir=tmp)), CLEAN_STEPS, None)
            print(
                f"no kills | {name}: startup {clean[name]['startup_s']:.1f} s, {clean[name]['step_s']:.4f} s per step",
                flush=True,
            )
        for every in args.every:
            steps = args.steps or math.ceil((args.kills + 0.5) * every / min(c["step_s"] for c in clean.values()))
            for name, runner in contenders.items():
                row = _row(steps, runner(Path(tempfile.mkdtemp(dir=tmp)), steps, every), clean[name])
                results[f"every {every:g} s: {name}"] = row
                print(f"kill every {every:g} s | {name}: {row}", flush=True)
    print()
    print(f"restart floor: {floor:.2f} s")
    print(
        "| kill every | contender | steady step | ETTR | lost per failure | back in: mean (min-max) | restart | of it imports and setup | reload | redone | kills |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        if not key.startswith("every "):
            continue
        every, name = key.split(": ", 1)
        setup = "-" if r["setup_s"] is None else f"{r['setup_s']:.1f} s"
        print(
            f"| {every.removeprefix('every ')} | {name} | {r['step_s']:.4f} s | {r['ettr']:.2f} | {r['lost_per_failure_s']:.1f} s | "
            f"{r['back_in_s']:.1f} s ({r['back_in_min_s']:.1f}-{r['back_in_max_s']:.1f}) | {r['restart_s']:.1f} s | {setup} | "
            f"{r['reload_s']:.2f} s | {r['redone_s']:.1f} s | {r['kills']} |"
        )
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
