"""The floor under a worker restart: what a new Ray Train worker process spends importing.

    python -m benchmarks.restart_floor             # 3 rounds, ~40 s on 2 cores

A worker loss makes Ray Train replace the whole group with new processes, and each imports
again what a rank of a ray_resume job needs before its first step: Ray Train's worker, its torch
backend, torch, `torch._dynamo` (DDP imports it in its constructor) and ray_resume's loop. This
times exactly that in fresh interpreters, one alone and then two at once (a 2-worker group on a
2-core machine), beside a bare `python -c pass` for the interpreter's own start. No Ray cluster
is started: what it prints is time no checkpointing scheme can win back inside those processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WORKER_IMPORTS = (
    "ray.train.v2._internal.execution.worker_group.worker",
    "ray.train.torch",
    "torch",
    "torch._dynamo",
    "ray_resume.api",
    "ray_resume.train_loop",
    "ray_resume.controller",
)
CASES = {"interpreter": "pass", "imports": "import " + ", ".join(WORKER_IMPORTS)}


def timed(code: str, at_once: int) -> float:
    """Seconds until the slowest of `at_once` fresh interpreters running `code` exits."""
    began = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(at_once)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"python -c {code!r} failed")
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = {}
    for at_once in (1, 2):
        for name, code in CASES.items():
            runs = [timed(code, at_once) for _ in range(args.rounds)]
            rows[f"{name}, {at_once} at once"] = {
                "median_s": statistics.median(runs),
                "min_s": min(runs),
                "max_s": max(runs),
            }
    print("| fresh processes | median s | min-max s |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_s']:.2f} | {row['min_s']:.2f}-{row['max_s']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"imports": WORKER_IMPORTS, "rounds": args.rounds, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
