"""An injected fault, for the tests and the quickstart's drill: kill a chosen rank (or the driver) at a
chosen step and phase, once per job.

Not part of a job's config: a `Fault` is handed to the driver (`ray_resume.train(..., fault=)`,
`python -m ray_resume.run ... --fault phase=...,step=...`), which hands it to the job's controller and,
in its `RankLaunch`, to every rank. A job without one, every job in production, carries None: each
phase below is then a test of None and nothing more (a shard file is written in one piece).
A fault fires once per job: the controller hands out a single claim, so the restarted worker group
runs through the same step unharmed. SIGKILL, not an exception: a real crash runs no cleanup and
flushes nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError

logger = logging.getLogger(__name__)

PHASES = (
    "after_optimizer_step",  # the rank dies after the step's optimizer step
    "mid_shard_write",  # the rank dies half way through writing a shard file of the step's save
    "before_report",  # the rank dies after writing the step's shards, before reporting them
    "commit_before_tracker",  # the driver dies after the step's iteration JSON files, before the tracker moves
    "commit_fails",  # the tracker write of the step's commit fails (an I/O error)
    "retention_delete",  # the driver dies half way through deleting iteration `step` (retention)
)
ON_THE_DRIVER = ("commit_before_tracker", "commit_fails", "retention_delete")


@dataclass(frozen=True)
class Fault:
    phase: str
    step: int  # the optimizer step (the iteration, for the driver's phases), >= 1
    rank: int = 0  # which rank dies (the rank phases)

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ConfigError(f"fault phase {self.phase!r} is not one of {', '.join(PHASES)}")
        for key, least in (("step", 1), ("rank", 0)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"fault {key} must be an integer >= {least}, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """`phase=after_optimizer_step,step=90,rank=1` (rank 0 when left out), as `--fault` takes it."""
        fields = dict(part.partition("=")[::2] for part in text.split(",") if part)
        unknown = set(fields) - {"phase", "step", "rank"}
        if unknown or "phase" not in fields or "step" not in fields:
            raise ConfigError(
                f"--fault {text!r}: write phase=PHASE,step=STEP[,rank=RANK]"
                + (f" ({', '.join(sorted(unknown))} is not one of them)" if unknown else "")
            )
        try:
            numbers = {key: int(fields[key]) for key in ("step", "rank") if key in fields}
        except ValueError:
            raise ConfigError(f"--fault {text!r}: step and rank are integers") from None
        return cls(fields["phase"], **numbers)

    def within(self, max_workers: int) -> None:
        """Checked on the driver before Ray starts: the rank that is to die exists."""
        if self.phase not in ON_THE_DRIVER and self.rank >= max_workers:
            raise ConfigError(
                f"fault rank {self.rank} must be < the largest world size scaling.num_workers ({max_workers})"
            )

    def at(self, phase: str, step: int, rank: int | None = None) -> bool:
        return self.phase == phase and self.step == step and (rank is None or self.rank == rank)


class FaultInjector:
    """A rank's side of the job's fault (None: no fault, nothing happens)."""

    def __init__(self, fault: Fault | None, rank: int, claim: Callable[[], bool]):
        self._fault = fault
        self._rank = rank
        self._claim = claim

    def armed(self, phase: str) -> bool:
        """Whether this rank has a fault to fire at `phase` at some step (else that phase costs nothing)."""
        return self._fault is not None and self._fault.phase == phase and self._fault.rank == self._rank

    def maybe_kill(self, phase: str, step: int) -> None:
        f = self._fault
        if f is None or not f.at(phase, step, self._rank):
            return
        if self._claim():
            logger.warning("[fault] killing rank %d at step %d in phase %s", self._rank, step, phase)
            os.kill(os.getpid(), signal.SIGKILL)
