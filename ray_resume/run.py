"""`python -m ray_resume.run CONFIG.yaml [--set key=value ...]`: the built-in job from a config file.

On a laptop it starts a local Ray; under `ray job submit` (RAY_ADDRESS is
set) or with `--address` it joins that cluster. Mistakes a user can fix
are found on the driver, before any worker starts, and said in one line.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from .api import train
from .config import load_config
from .driver import TrainingFailed
from .errors import USER_ERRORS
from .faults import PHASES, Fault

# Stopped on request before train_steps (SIGTERM): saved and committed, to be resumed. Neither 0
# (finished) nor 1/2 (failed, refused): 128 + SIGTERM, the status a scheduler (Kubernetes, Slurm,
# a RayJob) expects of a job it preempted and requeues.
EXIT_STOPPED = 128 + signal.SIGTERM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_resume.run", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, value parsed as YAML (repeatable)",
    )
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else start a local Ray)"
    )
    parser.add_argument("--verbose", action="store_true", help="also show Ray Train's and Ray Data's own console lines")
    parser.add_argument(
        "--fault",
        default=None,
        metavar="phase=PHASE,step=STEP[,rank=RANK]",
        help=f"a drill: kill rank RANK (or the driver) once, at STEP in PHASE ({', '.join(PHASES)})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        fault = Fault.parse(args.fault) if args.fault else None
        result = train(load_config(args.config, args.set), address=args.address, verbose=args.verbose, fault=fault)
    except USER_ERRORS as exc:  # found on the driver, or by a rank (and not retried)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return EXIT_STOPPED if result.metrics.get("stopped") else 0


if __name__ == "__main__":
    sys.exit(main())
