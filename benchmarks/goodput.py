"""Goodput under failures: the same job with a training worker SIGKILLed every `--every` seconds.

    python -m benchmarks.goodput                          # kills every 30 s and every 120 s, ~20 min
    python -m benchmarks.goodput --every 30 --steps 600   # one interval

Three contenders on the same 2-worker job (the quickstart's GPT, global batch 32, DDP on CPU):

* ours with the memory tier: durable saves every `--save-every` steps, snapshots every 5;
* ours with durable saves only;
* Ray Train without us: the pattern its docs teach, a `torch.save` of the model and optimizer
  every `--save-every` steps handed to `ray.train.report(checkpoint=...)`, and
  `ray.train.get_checkpoint()` + `torch.load` on a restart (batches drawn from a seeded
  generator per step, so no data loader is timed).

A killer thread picks a live `RayTrainWorker` every `--every` seconds (from the first step on) and
SIGKILLs it. Effective training time ratio (ETTR) = the steps that count x the contender's own
median step time / the wall time of `fit()`: 1.0 would be a job that never lost a second, not even
to start. The time lost per failure is split into restart (from the kill to the new group's
train function), reload (to the resumed state) and redone steps (steps run again, at the median
step time), from each contender's own timestamps.
"""

from __future__ import annotations

import argparse
import json
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


def live_workers() -> list[int]:
    return sorted(a["Pid"] for a in ray._private.state.actors(actor_state_name="ALIVE").values()
                  if a["ActorClassName"] == "RayTrainWorker" and a["Pid"])


class Killer(threading.Thread):
    """SIGKILLs one live training worker every `every` seconds, once `started()` is true."""

    def __init__(self, every: float, started):
        super().__init__(daemon=True)
        self.every, self.started, self.kills, self.done = every, started, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and not self.started():
            time.sleep(0.2)
        while not self.done.wait(self.every):
            pids = live_workers()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                self.kills.append(time.time())


def ours(tmp: Path, steps: int, save_every: int, memory_every: int, every: float, data: str) -> dict:
    from ray_resume.config import Config
    from ray_resume.metrics import read_metrics
    from ray_resume.run import run

    root = tmp / f"ours-{memory_every}"
    cfg = Config.from_dict({
        "name": f"goodput-{memory_every}", "model": QUICKSTART,
        "data": {"path": data, "synthetic": {"samples": 4096, "files": 4, "row_groups_per_file": 4}},
        "training": {"global_batch_size": BATCH, "micro_batch_size": 8, "train_steps": steps, "log_every": 50},
        "scaling": {"num_workers": 2}, "failure": {"max_failures": -1},
        "checkpoint": {"save_path": str(root), "save_interleaved_steps": save_every, "memory_interleaved_steps": memory_every},
    })
    started = lambda: any(root.parent.glob(f"{root.name}-metrics/*.jsonl"))
    killer = Killer(every, started)
    killer.start()
    began = time.time()
    result = run(cfg)
    wall = time.time() - began
    killer.done.set()
    assert result.error is None, result.error
    records = read_metrics(str(root))
    step_times = _step_times([r for r in records if r.get("rank") == 0 and "loss" in r])
    restarts = [r for r in records if r.get("event") == "restart"]
    return _summary(steps, wall, step_times, killer.kills, [
        {"restart": r.get("detect_s", 0) + r.get("new_group_s", 0), "reload": r["restore_s"], "redone": r["caught_up"] - r["step"]}
        for r in restarts])


def plain_train_func(config: dict) -> None:
    """What a Ray Train user writes without ray_resume (its docs' checkpointing pattern)."""
    import ray.train
    import ray.train.torch
    import torch

    from ray_resume.model import GPT

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
    log = open(config["log"], "a")
    if rank == 0:
        log.write(json.dumps({"event": "start", "entered": entered, "loaded": time.time(), "step": start}) + "\n")
    for step in range(start + 1, config["steps"] + 1):
        began = time.time()
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, QUICKSTART["vocab_size"], (BATCH, QUICKSTART["seq_len"] + 1), generator=g)[rank::world]
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % config["save_every"] == 0 or step == config["steps"]:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        if rank == 0:
            log.write(json.dumps({"step": step, "time": time.time(), "step_s": time.time() - began}) + "\n")
            log.flush()


def plain(tmp: Path, steps: int, save_every: int, every: float) -> dict:
    from ray.train.torch import TorchTrainer

    log = tmp / "plain.jsonl"
    killer = Killer(every, lambda: log.exists() and log.stat().st_size > 0)
    killer.start()
    trainer = TorchTrainer(plain_train_func, train_loop_config={"steps": steps, "save_every": save_every, "log": str(log)},
                           scaling_config=ray.train.ScalingConfig(num_workers=2),
                           run_config=ray.train.RunConfig(name=f"plain-{time.time_ns()}", storage_path=str(tmp / "plain"),
                                                          failure_config=ray.train.FailureConfig(max_failures=-1)))
    began = time.time()
    trainer.fit()
    wall = time.time() - began
    killer.done.set()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    step_times = _step_times([r for r in records if "step_s" in r])
    losses, reached = [], 0
    for r in records:
        if r.get("event") == "start" and reached:
            losses.append({"restart": r["entered"] - next(k for k in reversed(killer.kills) if k < r["entered"]),
                           "reload": r["loaded"] - r["entered"], "redone": reached - r["step"]})
        reached = r.get("step", reached) if "step_s" in r else reached
    return _summary(steps, wall, step_times, killer.kills, losses)


def _step_times(records: list[dict]) -> list[float]:
    """Each step's duration: its own `step_s`, or the gap between consecutive records of one attempt."""
    if records and "step_s" in records[0]:
        return [r["step_s"] for r in records]
    gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:])
            if b["step"] == a["step"] + 1 and b.get("attempt") == a.get("attempt") and not b.get("saved")]
    return gaps


def _summary(steps: int, wall: float, step_times: list[float], kills: list[float], losses: list[dict]) -> dict:
    step_s = statistics.median(step_times)
    restart = statistics.mean([x["restart"] for x in losses]) if losses else 0.0
    reload = statistics.mean([x["reload"] for x in losses]) if losses else 0.0
    redone = statistics.mean([x["redone"] for x in losses]) * step_s if losses else 0.0
    return {"steps": steps, "wall_s": round(wall, 1), "kills": len(kills), "restarts": len(losses), "median_step_s": round(step_s, 4),
            "ettr": round(steps * step_s / wall, 3), "lost_per_failure_s": round(restart + reload + redone, 1),
            "restart_s": round(restart, 1), "reload_s": round(reload, 2), "redone_s": round(redone, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, nargs="+", default=[30, 120], help="seconds between kills")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default: 12 x --every, at least 600)")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/goodput_results.json")
    args = parser.parse_args(argv)
    from ray_resume.run import init_local_ray

    init_local_ray(num_cpus=4)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "data")
        for every in args.every:
            steps = args.steps or max(600, int(12 * every))
            for name, runner in (("ours, memory tier", lambda t: ours(t, steps, args.save_every, 5, every, data)),
                                 ("ours, durable only", lambda t: ours(t, steps, args.save_every, 0, every, data)),
                                 ("Ray Train + torch.save", lambda t: plain(t, steps, args.save_every, every))):
                run_dir = Path(tempfile.mkdtemp(dir=tmp))
                results[f"every {every:g} s: {name}"] = row = runner(run_dir)
                print(f"kill every {every:g} s | {name}: {row}", flush=True)
    print()
    print("| kill every | contender | ETTR | lost per failure | restart | reload | redone | kills |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        every, name = key.split(": ", 1)
        print(f"| {every.removeprefix('every ')} | {name} | {r['ettr']:.2f} | {r['lost_per_failure_s']:.1f} s | {r['restart_s']:.1f} s | "
              f"{r['reload_s']:.2f} s | {r['redone_s']:.1f} s | {r['kills']} |")
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
