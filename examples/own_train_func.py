"""Your own Ray Train train_func, checkpointed by ray_resume (ray_resume.fit / get_checkpointer).

    python examples/own_train_func.py                 # 60 steps on 2 workers, a save every 20; run it again: it resumes
    python examples/own_train_func.py --kill-at 30    # rank 1 SIGKILLed after step 30: Ray Train restarts, it resumes from 20

A plain loop: DDP through ray.train.torch.prepare_model, SGD with Nesterov
momentum, a cosine LR schedule, dropout, and a stateful object of its own
(a per-rank sample counter), all restored exactly. The global batch of a
step is a pure function of the step, sliced by rank, so the run is the same
whatever the world size.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import tempfile
import time

import numpy as np
import ray.train
import torch

import ray_resume

STEPS, BATCH, SAVE_EVERY = 60, 32, 20
log = logging.getLogger("own_train_func")  # a print() on a Ray Train worker reaches the console twice
NAME = "own-train-func"  # the run's name; lines that begin "[NAME] " are never folded by Ray's log deduplication


class SampleCounter:
    """The samples this rank has seen: anything with state_dict()/load_state_dict() can be `extra`."""

    def __init__(self):
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def train_func(config: dict) -> None:
    import ray.train
    import ray.train.torch

    ck = ray_resume.get_checkpointer()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001)
    counter = SampleCounter()
    start = ck.restore(model, opt, extra={"sched": sched, "counter": counter})
    if start.source is None:  # a fresh start: each rank's own random streams (a resume restores them)
        torch.manual_seed(1 + rank)
        np.random.seed(1 + rank)
        random.seed(1 + rank)
    elif rank == 0:
        log.info(f"[{NAME}] resumed from %s at step %d, lr %.4f", start.source, start.step, sched.get_last_lr()[0])
    for step in range(start.step + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 16, generator=g)
        y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
        xs, ys = x[rank::world], y[rank::world]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs), ys)
        loss.backward()
        opt.step()
        sched.step()
        counter.seen += len(xs)
        if step == config.get("kill_at") and rank == 1 and not os.path.exists(config["marker"]):
            # The demo's crash: first let the save before it commit (saves are asynchronous, and a busy
            # machine may take longer than the steps between), so that the restart resumes from it.
            wait_for_commit(config["root"], step // SAVE_EVERY * SAVE_EVERY)
            open(config["marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        ck.maybe_save(step, consumed_samples=step * BATCH, global_batch_size=BATCH)
        if rank == 0 and step % 10 == 0:
            log.info(
                f"[{NAME}] step %d/%d | loss %.4f | lr %.4f | rank 0 saw %d samples",
                step,
                STEPS,
                loss.item(),
                sched.get_last_lr()[0],
                counter.seen,
            )


def wait_for_commit(root: str, step: int, timeout_s: float = 60.0) -> None:
    """Until the root's tracker (MindFormers' latest_checkpointed_iteration.txt) names `step` or later."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
                if int(f.read()) >= step:
                    return
        except (OSError, ValueError):  # nothing committed yet
            pass
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--root", default="output/own_train_func", help="checkpoint root (resumes from it when it holds a commit)"
    )
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL rank 1 after this step, once")
    args = p.parse_args()
    root = os.path.abspath(args.root)
    marker = os.path.join(tempfile.gettempdir(), f"own_train_func-killed-{os.getpid()}")
    try:
        result = ray_resume.fit(
            train_func,
            train_loop_config={"kill_at": args.kill_at, "marker": marker, "root": root},
            checkpoint={"save_path": root, "load_path": root, "save_interleaved_steps": SAVE_EVERY},
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(name=NAME, failure_config=ray.train.FailureConfig(max_failures=2)),
        )
    except ray.train.TrainingFailedError as exc:
        print(f"error: {exc}")
        return
    if result.committed_iteration is None:
        print(f"nothing left to do: {root} already holds step {STEPS} (rm -rf it to start over)")
    else:
        print(f"committed iteration {result.committed_iteration} at {result.checkpoint_path}")


if __name__ == "__main__":
    main()
