"""One background writer thread per rank: at most one save in flight.

The training loop hands a save (already snapshotted) to `BackgroundSave`
and goes on; the thread serializes, writes, fsyncs and reports it. The
next save waits for this one first (its snapshot buffers are reused), and
a failure in the thread is raised on the training thread at the next
`poll()`/`wait()` — never swallowed, never raised twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ...errors import AsyncSaveError

logger = logging.getLogger(__name__)


class BackgroundSave:
    def __init__(self, name: str = "ckpt-writer"):
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future] | None = None  # (step, future) of the save in flight

    def submit(self, step: int, fn: Callable[[], object]) -> None:
        """Run `fn` in the writer thread; the caller must have waited for the previous save."""
        if self._pending is not None:
            raise RuntimeError(f"save of iteration {self._pending[0]} is still in flight; wait() first")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        self._pending = (step, self._executor.submit(fn))

    @property
    def in_flight(self) -> bool:
        """Whether a save is being written now (benchmarks: is a half-cycle clean of writes)."""
        return self._pending is not None and not self._pending[1].done()

    def poll(self) -> None:
        """Raise now if the save in flight already failed; never blocks."""
        if self._pending is not None and self._pending[1].done() and self._pending[1].exception() is not None:
            self.wait()

    def wait(self) -> float:
        """Block until the save in flight (if any) is done; return seconds blocked. Raises its error."""
        if self._pending is None:
            return 0.0
        step, future = self._pending
        start = time.perf_counter()
        try:
            future.result()
        except BaseException as exc:
            raise AsyncSaveError(f"asynchronous checkpoint save of iteration {step} failed: {exc!r}") from exc
        finally:
            self._pending = None  # reported once; the next save starts clean
        return time.perf_counter() - start

    def close(self) -> float:
        """Wait for the save in flight and stop the thread; returns seconds blocked."""
        try:
            return self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
