"""`checkpoint.async_save: auto`: whether a group's saves are written in the background, decided on
its own steps.

A sync save costs training its whole stall. An async one costs its copy (its stall) and what its
background write takes from the steps after it: on busy cores the writer competes with the ranks,
and DDP's lockstep makes every rank wait for the slowest. Which is cheaper depends on the model, the
cores and the storage, so each group measures it on its first saves:

1. the first save is sync and warms up what an async save needs (a writer process if one writes,
   the snapshot buffers, their pages): none of it is measured;
2. the second is sync: its stall, then the steps after it (nothing in flight), per step;
3. the third is async: its stall, then the steps after it (its write in flight), per step;
4. at the fourth, rank 0 compares the sync stall with the async one plus what the steps after it
   took beyond those after the sync save, and every rank saves the cheaper way from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WARMUP, SYNC, ASYNC = range(3)  # the measuring saves, in order


@dataclass
class Timed:
    step: int
    entered: float  # time.perf_counter() when the save was asked for
    left: float  # and when training went on

    @property
    def stall(self) -> float:
        return self.left - self.entered


@dataclass
class AsyncChoice:
    decided: bool | None = None  # None: still measuring
    why: str = ""
    decided_at: int | None = None  # the save's step
    timed: list[Timed] = field(default_factory=list)  # the measuring saves

    @property
    def warming_up(self) -> bool:
        return self.decided is None and len(self.timed) == WARMUP

    def next_is_async(self) -> bool | None:
        """How the next save goes; None: it is time to decide (`decide`)."""
        if self.decided is not None:
            return self.decided
        return len(self.timed) == ASYNC if len(self.timed) <= ASYNC else None

    def saved(self, step: int, entered: float, left: float) -> None:
        if self.decided is None:
            self.timed.append(Timed(step, entered, left))

    def measure(self, step: int, now: float, waited: float) -> tuple[bool, str]:
        """This rank's verdict at save `step`, asked for at `now` after `waited` seconds for the async
        save's write (a cost of it too): async or not, and why in one line."""
        sync, async_ = self.timed[SYNC], self.timed[ASYNC]
        steps = max(1, step - async_.step)  # a step saved twice (forced) counts one
        after_sync = (async_.entered - sync.left) / max(1, async_.step - sync.step)
        after_async = (now - async_.left) / steps
        slower = (after_async - after_sync) * steps
        # Steps faster after the async save are this machine's drift, not the save's gain: no credit.
        cost = async_.stall + max(slower, 0.0) + waited
        choice = cost < sync.stall
        why = (
            f"{'async' if choice else 'sync'}: a sync save blocked training {sync.stall:.3f} s, an async one "
            f"{async_.stall:.3f} s, the {steps} steps after it took {slower:+.3f} s more than those after the "
            f"sync save and the next save waited {waited:.3f} s for its write ({cost:.3f} s in all)"
        )
        return choice, why

    def decide(self, step: int, choice: bool, why: str) -> None:
        self.decided, self.why, self.decided_at = choice, why, step
