"""What tests/test_ray_range.py runs in a venv of another Ray: a user's two ways in, each with rank 1
SIGKILLed after step 6, on one local Ray started here. It prints one JSON line: `ray`, the version this
interpreter imports; `built_in`, the steps the built-in job's groups started at (`ray_resume.train`
of the config given, whose shards the test compares with the suite's uninterrupted run); `fit`, the
steps each group of `ray_resume.fit` with a user's own loop (DDP, SGD with momentum, dropout)
started at, and the iteration it committed last.

    python tests/ray_range_check.py WORKDIR CONFIG.json
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

STEPS, EVERY, BATCH = 12, 4, 8


def committed_4(root: str) -> None:
    """Wait (60 s at most) for iteration 4's commit: the save is async, and on a busy machine a kill
    at step 6 came before 4's background write had reported (the restart then rightly began at 0)."""
    import time

    tracker = Path(root) / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tracker.exists() and int(tracker.read_text() or 0) >= 4):
        time.sleep(0.05)


def train_func(config: dict) -> None:
    """A user's own Ray Train loop, as the README writes one (it travels by value: it is __main__'s)."""
    import random

    import numpy as np
    import ray.train
    import ray.train.torch
    import torch

    import ray_resume

    ck = ray_resume.get_checkpointer()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3))
    model = ray.train.torch.prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    start = ck.restore(model, opt)
    if start.source is None:  # each rank's streams, as a user seeds them (numpy's too: it is in the checkpoint)
        torch.manual_seed(100 + rank)
        np.random.seed(100 + rank)
        random.seed(100 + rank)
    if rank == 0:
        with open(config["starts"], "a") as f:
            f.write(f"{start.step}\n")
    for step in range(start.step + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
        if step == 6 and rank == 1 and not os.path.exists(config["marker"]):
            committed_4(config["root"])
            open(config["marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        ck.maybe_save(step, consumed_samples=step * BATCH, global_batch_size=BATCH)


def main(work: Path, config: dict) -> dict:
    import ray
    import ray.train

    import ray_resume
    from ray_resume.ray_backend import init_local_ray
    from ray_resume.metrics import read_metrics

    init_local_ray(num_cpus=4)
    ray_resume.train(config, fault={"phase": "after_optimizer_step", "step": 6, "rank": 1})
    root = config["checkpoint"]["save_path"]
    built_in = [r["step"] for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0]
    loop = {"marker": str(work / "fit.killed"), "starts": str(work / "fit.starts"), "root": str(work / "fit")}
    result = ray_resume.fit(
        train_func,
        train_loop_config=loop,
        checkpoint={"save_path": str(work / "fit"), "save_interleaved_steps": EVERY},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=2)),
    )
    fit = {
        "starts": [int(s) for s in Path(loop["starts"]).read_text().split()],
        "committed": result.committed_iteration,
    }
    return {"ray": ray.__version__, "built_in": {"starts": built_in}, "fit": fit}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))), flush=True)
