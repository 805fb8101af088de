"""Fault injection for tests: kill a chosen rank at a chosen step and phase.

Configured by the `fault:` block of the config (`--set fault.phase=...`).
A fault fires once per job: the job controller on the driver hands out a single
claim, so the restarted worker group runs through the same step unharmed.
SIGKILL, not an exception: a real crash runs no cleanup and flushes nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

logger = logging.getLogger(__name__)


class FaultInjector:
    def __init__(self, fault, rank: int, claim: Callable[[], bool]):
        self._fault = fault  # a config.FaultConfig or None
        self._rank = rank
        self._claim = claim

    def maybe_kill(self, phase: str, step: int) -> None:
        f = self._fault
        if f is None or f.phase != phase or f.step != step or f.rank != self._rank:
            return
        if self._claim():
            logger.warning("[fault] killing rank %d at step %d in phase %s", self._rank, step, phase)
            os.kill(os.getpid(), signal.SIGKILL)
