"""What a worker kill costs: ours against Ray Train's own checkpoint pattern, in one run, part by part.

    python -m benchmarks.goodput                       # the job's own step time, then steps of 0.5 s: ~15 min
    python -m benchmarks.goodput --step-sleep 0        # the job's own step time only, ~3 min
    python -m benchmarks.goodput --step-sleep 0 --only ours --ray-env RAY_worker_niceness=0   # a cluster setting

Both contenders run the same train_func on 2 workers (the quickstart's GPT and data, global batch 32
in one micro-batch of 16 per rank, DDP on CPU, AdamW, batches from the same `ray_resume.SampleStream`),
through Ray Train with `FailureConfig(max_failures=-1)`. Only the checkpointing differs:

* ours: `ray_resume.fit`, `restore` once and `maybe_save` every step: a durable save every
  `--save-every` steps and the memory tier as configured by default (`memory_interleaved_steps:
  auto`: each group snapshots at the interval that costs at most 5% of its time), or every
  `--memory-every` steps;
* Ray Train's pattern, as its docs teach it: a `torch.save` of the model and the optimizer every
  `--save-every` steps handed to `ray.train.report(checkpoint=...)`, and `ray.train.get_checkpoint()`
  + `torch.load` at a restart.

With `--step-sleep S` every step of both sleeps S seconds besides its work: the step time of real
training, where what a restart redoes costs what it costs there.

Each run is `(kills + 1) x save_every` steps long. Rank 1 SIGKILLs itself at the end of the step
after rank 0 has logged step `k x save_every + offset_k` (k = 1..kills, the offsets drawn once from
`--seed` in [1, save_every): the same steps for both contenders), so a kill lands anywhere between
two durable saves, as a failure does. Per kill, from each contender's own timestamps and from the
lost group's last finished step: *noticed and new processes* (to the new rank 0's process start),
*imports and setup* (to its train_func), *build and restore* (to the restored state), the *redone*
steps (the steps run again, at the run's steady step time) and *back in* (to that last step
finished again). *Lost per kill* is the run's wall time less its startup and its steps at
its steady step time (the mean step after each group's first SETTLE steps, saves included,
measured in the same run), divided by the kills: all of the above and each new group's slower
first steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


QUICKSTART = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layers": 2, "n_heads": 4}
BATCH = 32
SETTLE = 25  # steps of each group's start left out of the steady step time (its first steps run slower)
CONTENDERS = ("ours, memory tier", "Ray Train + torch.save")


def process_started() -> float:
    """When this process started, on time.time()'s clock."""
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        since_boot = float(uptime.read().split()[0])
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def train_func(config: dict) -> None:
    """One loop for both contenders; `config["ours"]` says whose checkpointing it uses."""
    entered = time.time()
    import ray.train
    import ray.train.torch
    import torch

    from ray_resume import SampleStream
    from ray_resume.data import quiet_ray_data
    from ray_resume.model import GPT

    quiet_ray_data()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(GPT(**QUICKSTART, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if config["ours"]:
        import ray_resume

        ck = ray_resume.get_checkpointer()
        start = ck.restore(model, opt).step
    else:
        start, checkpoint = 0, ray.train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as d:
                state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"]
    batches = iter(SampleStream(config["data"], 1234, True, BATCH, rank, world, start * BATCH))
    log = open(config["log"], "a")
    if rank == 0:
        started = {"process": process_started(), "entered": entered, "loaded": time.time(), "step": start}
        log.write(json.dumps({"event": "start", **started}) + "\n")
        log.flush()
    for step in range(start + 1, config["steps"] + 1):
        tokens = torch.as_tensor(next(batches)["input_ids"]).long()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(config["sleep"])
        if config["ours"]:
            ck.maybe_save(step, consumed_samples=step * BATCH, global_batch_size=BATCH)
        elif step % config["save_every"] == 0 or step == config["steps"]:
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
        elif os.path.exists(config["kill"]):  # the killer's word: this process dies now, as a failure would
            os.remove(config["kill"])
            os.kill(os.getpid(), signal.SIGKILL)


class Killer(threading.Thread):
    """Has rank 1 SIGKILLed once rank 0 has logged each step of `at`: it leaves a word that rank 1 takes
    at the end of its next step, so that the kill lands at the same step for both contenders."""

    def __init__(self, log: Path, at: list[int], word: Path):
        super().__init__(daemon=True)
        self.log, self.at, self.word, self.kills, self.done = log, list(at), word, [], threading.Event()
        self.start()

    def run(self) -> None:
        while self.at and not self.done.wait(0.01):
            steps = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
            if any(r.get("step", 0) >= self.at[0] and "time" in r for r in steps) and not self.word.exists():
                self.word.touch()
                self.kills.append({"step": self.at.pop(0), "time": time.time()})


def run(
    contender: str,
    tmp: Path,
    data: str,
    *,
    steps: int,
    save_every: int,
    memory_every: int | str,
    sleep: float,
    kill_at: list[int],
) -> dict:
    """One run of `contender` with its kills; its wall time and each kill's parts."""
    import ray.train
    from ray.train.torch import TorchTrainer

    import ray_resume

    log, word = tmp / "steps.jsonl", tmp / "kill-now"
    loop = {"steps": steps, "save_every": save_every, "log": str(log), "kill": str(word), "data": data, "sleep": sleep}
    scaling = ray.train.ScalingConfig(num_workers=2)
    run_config = ray.train.RunConfig(
        failure_config=ray.train.FailureConfig(max_failures=-1), storage_path=str(tmp / "ray")
    )
    killer = Killer(log, kill_at, word)
    began = time.time()
    if contender.startswith("ours"):
        checkpoint = {"save_path": str(tmp / "ckpt"), "save_interleaved_steps": save_every}
        checkpoint["memory_interleaved_steps"] = memory_every
        ray_resume.fit(
            train_func,
            train_loop_config={**loop, "ours": True},
            checkpoint=checkpoint,
            scaling_config=scaling,
            run_config=run_config,
        )
    else:
        TorchTrainer(
            train_func, train_loop_config={**loop, "ours": False}, scaling_config=scaling, run_config=run_config
        ).fit()
    ended = time.time()
    killer.done.set()
    return measured(began, ended, [json.loads(line) for line in log.read_text().splitlines()], killer.kills)


def measured(began: float, ended: float, records: list[dict], kills: list[dict]) -> dict:
    """The run's wall time, startup and steady step time, and each kill's parts (see the module's doc)."""
    starts, steps_run, attempt = [], [], -1
    for r in records:
        if r.get("event") == "start":
            attempt += 1
            starts.append(r)
        else:
            steps_run.append({**r, "attempt": attempt})
    gaps = [
        b["time"] - a["time"]
        for a, b in zip(steps_run, steps_run[1:])
        if b["attempt"] == a["attempt"]
        and b["step"] == a["step"] + 1
        and a["step"] - starts[a["attempt"]]["step"] >= SETTLE
    ]
    step_s = statistics.mean(gaps)
    per_kill = []
    for lost, (kill, start) in enumerate(zip(kills, starts[1:])):
        last = [r for r in steps_run if r["attempt"] == lost][-1]  # the lost group's last finished step
        again = [r["time"] for r in steps_run if r["attempt"] > lost and r["step"] >= last["step"]]
        per_kill.append(
            {
                "step": last["step"],
                "new_processes_s": start["process"] - last["time"],
                "imports_and_setup_s": start["entered"] - start["process"],
                "build_and_restore_s": start["loaded"] - start["entered"],
                "redone_steps": last["step"] - start["step"],
                "back_in_s": min(again) - last["time"],
            }
        )
    startup = steps_run[0]["time"] - began - step_s
    lost = (ended - began) - startup - len({r["step"] for r in steps_run}) * step_s
    return {
        "wall_s": ended - began,
        "startup_s": startup,
        "step_s": step_s,
        "kills": len(kills),
        "lost_per_kill_s": lost / max(1, len(kills)),
        "per_kill": per_kill,
    }


def row(sleep: float, name: str, r: dict) -> str:
    """A run's line of the table: its step time, what a kill lost, against Ray Train's, and the kill's parts."""
    mean = lambda key: statistics.mean(k[key] for k in r["per_kill"]) if r["per_kill"] else 0.0
    return (
        f"| {sleep:g} s | {name} | {r['step_s']:.3f} s | {r['lost_per_kill_s']:.1f} s | {r['vs_ray_train']:.2f}× | "
        f"{mean('back_in_s'):.1f} s | {mean('new_processes_s'):.1f} s | {mean('imports_and_setup_s'):.1f} s | "
        f"{mean('build_and_restore_s'):.2f} s | {mean('redone_steps'):.1f} ({mean('redone_steps') * r['step_s']:.1f} s) | "
        f"{r['kills']} |"
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-sleep", type=float, nargs="+", default=[0.0, 0.5], help="seconds each step sleeps")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument(
        "--memory-every",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="ours: memory_interleaved_steps",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the kill steps")
    parser.add_argument("--only", choices=["ours", "theirs"], help="one contender (no ratio)")
    parser.add_argument(
        "--ray-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="settings of the Ray started here (its raylet's environment)",
    )
    parser.add_argument("--out", default="benchmarks/goodput_results.json")
    args = parser.parse_args(argv)
    from ray_resume.config import SyntheticDataConfig
    from ray_resume.data import ensure_dataset
    from ray_resume.ray_backend import init_local_ray

    draw = random.Random(args.seed)
    kill_at = [k * args.save_every + draw.randrange(1, args.save_every) for k in range(1, args.kills + 1)]
    steps = (args.kills + 1) * args.save_every
    os.environ.update(setting.split("=", 1) for setting in args.ray_env)  # before Ray starts: its raylet's
    init_local_ray(num_cpus=4)
    contenders = [c for c in CONTENDERS if args.only is None or (c == CONTENDERS[0]) == (args.only == "ours")]
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "kill_at": kill_at,
        "steps": steps,
        "ray_env": args.ray_env,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        ensure_dataset(
            data,
            SyntheticDataConfig(samples=4096, files=4, row_groups_per_file=4),
            QUICKSTART["seq_len"],
            QUICKSTART["vocab_size"],
        )
        for sleep in args.step_sleep:
            for name in contenders:
                r = run(
                    name,
                    Path(tempfile.mkdtemp(dir=tmp)),
                    data,
                    steps=steps,
                    save_every=args.save_every,
                    memory_every=args.memory_every,
                    sleep=sleep,
                    kill_at=kill_at,
                )
                results["runs"][f"sleep {sleep:g} s: {name}"] = r
                print(f"sleep {sleep:g} s | {name}: {json.dumps(r)}", flush=True)
    print(
        f"\n{steps} steps, rank 1 killed after steps {kill_at}; durable saves every {args.save_every} steps, ours with memory_interleaved_steps: {args.memory_every}\n"
    )
    print(
        "| step sleep | contender | steady step | lost per kill | × Ray Train's | back in | noticed and new processes | imports and setup | build and restore | redone steps | kills |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sleep in args.step_sleep:
        theirs = results["runs"].get(f"sleep {sleep:g} s: {CONTENDERS[1]}", {}).get("lost_per_kill_s", math.nan)
        for name in contenders:
            r = results["runs"][f"sleep {sleep:g} s: {name}"]
            r["vs_ray_train"] = r["lost_per_kill_s"] / theirs
            print(row(sleep, name, r))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
