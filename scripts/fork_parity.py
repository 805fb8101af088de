"""Is a rank forked from the fork server the process Ray would have started? The same `fit()`, a
2-rank job that loses rank 1 once, with `failure.fork_server` on and off, and what each rank of each
group could observe compared (invariant 15; tests/test_fork_parity.py, scripts/gpu_check.py).

    python scripts/fork_parity.py [--gpu]     # on this machine's Ray (or a local one): the facts that differ

A fact is either one value a rank has (its threads, limits, signals, ...: the same rank of the same
group must have the same value on and off) or a random draw (numpy, `random`, the OS: distinct across
every rank start of a run, on as off). After the job: which ranks' `atexit` handlers ran, which
processes they spawned outlived them, and the committed shard bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STEPS = 4
# random facts: distinct across the rank starts of a run
DRAWN = ("numpy", "random", "urandom", "torch_seed", "str_hash")


def describe_handler(handler) -> str:
    if handler in (signal.SIG_DFL, signal.SIG_IGN) or handler is None:
        return str(handler)
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', type(handler).__name__)}"


def rank_facts() -> dict:
    """What a user's code can observe of its process, read before it seeds or changes anything."""
    import random
    import resource

    import numpy as np
    import torch

    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    mask = os.umask(0)
    os.umask(mask)
    try:
        from threadpoolctl import threadpool_info

        pools = sorted(f"{p['user_api']}:{p['internal_api']}:{p['num_threads']}" for p in threadpool_info())
    except ImportError:  # the GPU machine may not have it
        pools = None
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}
    argv = sys.argv
    return {
        "numpy": np.random.random(2).tolist(),
        "random": random.random(),
        "urandom": os.urandom(8).hex(),
        "torch_seed": torch.initial_seed(),
        "str_hash": hash("ray_resume"),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "native_thread_pools": pools,
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "env_keys": sorted(os.environ),
        "cwd": os.getcwd().rsplit("-", 3)[0],  # less the run's date and time (Ray Train names a run's directory so)
        "sys_path": sys.path,
        "argv": [argv[0], *sorted(a.split("=", 1)[0] for a in argv[1:])],  # the values are this process's ports, tokens
        "orig_argv": [Path(sys.orig_argv[0]).name, *sys.orig_argv[1:2]],
        "rlimits": limits,
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "scheduler": os.sched_getscheduler(0),
        "umask": mask,
        "signal_handlers": {
            s.name: describe_handler(signal.getsignal(s))
            for s in signal.valid_signals()
            if isinstance(s, signal.Signals)
        },
        "signal_masks": {k: status[k].strip() for k in ("SigIgn", "SigCgt")},
        "cgroup": Path("/proc/self/cgroup").read_text(),
        "process_group_leader": os.getpgid(0) == os.getpid(),
        "main_module": Path(getattr(sys.modules["__main__"], "__file__", "") or "").name,
        "recursion_limit": sys.getrecursionlimit(),
        "switch_interval": sys.getswitchinterval(),
        "gc": [gc.isenabled(), list(gc.get_threshold())],
        "python_threads": sorted(re.sub(r"\d+", "N", t.name) for t in threading.enumerate()),
    }


def train_func(config: dict) -> None:
    """Record this rank's facts, leave an `atexit` mark and a spawned process, then train a seeded
    model (bytes comparable on and off) and lose rank 1 once at step 2."""
    import atexit
    import random

    import numpy as np
    import ray.train
    import torch

    import ray_resume

    ctx = ray.train.get_context()
    rank, out = ctx.get_world_rank(), Path(config["dir"])
    attempt = "restarted" if (out / "killed").exists() else "first"
    facts = rank_facts()
    spawned = subprocess.Popen(["sleep", "600"])
    facts.update(pid=os.getpid(), parent=os.getppid(), spawned=spawned.pid)
    (out / f"{attempt}-{rank}.json").write_text(json.dumps(facts))
    atexit.register(lambda: (out / f"atexit-{attempt}-{rank}").write_text("ran"))

    torch.manual_seed(0)  # as a job whose bytes repeat seeds (the checkpoint holds each generator's state)
    np.random.seed(rank)
    random.seed(rank)
    device = torch.device("cuda", torch.cuda.current_device()) if config["gpu"] else torch.device("cpu")
    ck = ray_resume.get_checkpointer()
    model = torch.nn.Linear(4, 4).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    start = ck.restore(model, opt)
    for step in range(start.step + 1, STEPS + 1):
        loss = model(torch.ones(2, 4, device=device)).square().mean()
        loss.backward()
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        if attempt == "first" and step == 2 and rank == 1:
            (out / "killed").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        ck.maybe_save(step, consumed_samples=step, global_batch_size=1)


def run(out: Path, fork_server: bool, gpu: bool = False) -> dict:
    """The job with `failure.fork_server` set so; every rank start's facts (`first-0`, ...), the ends
    (`atexit`: whose handlers ran; `outlived`: whose spawned process is still there), the shard bytes."""
    import ray.train
    from ray import cloudpickle

    import ray_resume
    from ray_resume.checkpoint import paths

    out.mkdir(parents=True)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        result = ray_resume.fit(
            train_func,
            train_loop_config={"dir": str(out), "gpu": gpu},
            checkpoint={"save_path": str(out / "root"), "save_interleaved_steps": 1},
            scaling_config=ray.train.ScalingConfig(
                num_workers=2, use_gpu=gpu, resources_per_worker={"GPU" if gpu else "CPU": 1}
            ),
            failure_config={"max_failures": 1, "fork_server": fork_server},
        )
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert result.committed_iteration == STEPS, result.error
    starts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*-[0-9].json"))}
    deadline = time.monotonic() + 10  # Ray ends the last group's processes after fit() returns
    while time.monotonic() < deadline and any(Path(f"/proc/{f['pid']}").exists() for f in starts.values()):
        time.sleep(0.2)
    while time.monotonic() < deadline + 10 and any(Path(f"/proc/{f['spawned']}").exists() for f in starts.values()):
        time.sleep(0.2)  # and the raylet ends a worker's process group after the worker
    outlived = []
    for name, f in starts.items():
        if Path(f"/proc/{f['spawned']}").exists():
            outlived.append(name)
            os.kill(f["spawned"], signal.SIGKILL)
    directory = Path(paths.iteration_dir(str(out / "root"), STEPS))
    return {
        "starts": starts,
        "atexit": sorted(p.name[len("atexit-") :] for p in out.glob("atexit-*")),
        "outlived": sorted(outlived),
        "bytes": {p.name: p.read_bytes().hex() for p in sorted(directory.glob("*.safetensors"))},
    }


def differences(on: dict, off: dict) -> list[str]:
    """What a user could tell apart: one line per fact that is not the same on as off."""
    found = []
    if sorted(on["starts"]) != sorted(off["starts"]):
        return [f"rank starts: on {sorted(on['starts'])}, off {sorted(off['starts'])}"]
    for fact in off["starts"]["first-0"]:
        if fact in ("pid", "parent", "spawned"):
            continue
        if fact in DRAWN:  # distinct across rank starts, on as off
            distinct = {
                name: len({json.dumps(f[fact]) for f in run["starts"].values()}) == len(run["starts"])
                for name, run in (("on", on), ("off", off))
            }
            if distinct["on"] != distinct["off"]:
                found.append(f"{fact}: distinct across rank starts on {distinct['on']}, off {distinct['off']}")
            continue
        for start in off["starts"]:
            a, b = on["starts"][start][fact], off["starts"][start][fact]
            if a != b:
                found.append(f"{fact} ({start}): on {_short(a, b)}, off {_short(b, a)}")
    for end in ("atexit", "outlived", "bytes"):
        if on[end] != off[end]:
            found.append(f"{end}: on {_short(on[end], off[end])}, off {_short(off[end], on[end])}")
    return found


def _short(value, other) -> str:
    """`value`, or where both are collections, what it has that `other` lacks."""
    if isinstance(value, list) and isinstance(other, list):
        return f"+{[v for v in value if v not in other]}"
    if isinstance(value, dict) and isinstance(other, dict):
        return str({k: v for k, v in value.items() if other.get(k) != v})[:400]
    return repr(value)[:400]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="ranks on GPUs (NCCL)")
    parser.add_argument("--out", help="a file for the facts and the differences (JSON)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(Path(tmp, name), name == "on", args.gpu) for name in ("off", "on")}
    found = differences(runs["on"], runs["off"])
    facts = len(runs["off"]["starts"]["first-0"])  # less pid, parent, spawned; plus atexit, outlived, bytes
    print(
        f"[fork-parity] {facts} facts per rank start, {len(runs['off']['starts'])} rank starts: "
        + ("all equal on and off" if not found else f"{len(found)} differ")
    )
    for line in found:
        print(f"[fork-parity]   {line}")
    if args.out:
        Path(args.out).write_text(json.dumps({"differences": found, "runs": runs}, indent=1) + "\n")
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
