"""A call to the job's controller or a memory keeper: on its Ray actor, or on the plain object
itself (the tests' harness), the same way. Ranks make them through `controller.client.ControllerClient`.

A method is named by the class's own function (`call(handle, JobController.report, ...)`), never by
a string: a renamed or mistyped method fails where the call is written, on every backend.

It imports no Ray (it finds Ray's actor handles only where Ray is loaded), so that the
checkpoint core runs where Ray is not installed (scripts/gpu_check.py on a bare GPU machine).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

Method = TypeVar("Method", bound=Callable)

SAVE_AND_STOP, STOP_NOW = 1, 2  # should_stop's answers, ordered: the ranks agree on the largest


def serial(method: Method) -> Method:
    """Marks a method that changes the job's state: on the actor it runs one at a time in a
    concurrency group of its own ("state"), so that, queued there behind a slow commit, it holds
    none of the threads that answer the per-step calls (should_stop, last_committed, stepped),
    however many ranks report."""
    method.serial = True
    return method


def _ray_actor(controller):
    """Ray, when `controller` is one of its actor handles (none can exist before Ray is imported)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and isinstance(controller, ray.actor.ActorHandle) else None


def call(controller, method: Callable, *args):
    """Call `method` on `controller`: remotely on its Ray actor, directly on anything else."""
    ray = _ray_actor(controller)
    bound = getattr(controller, method.__name__)
    if ray is None:
        return bound(*args)
    if getattr(method, "serial", False):
        bound = bound.options(concurrency_group="state")
    return ray.get(bound.remote(*args))


def tell(controller, method: Callable, *args) -> None:
    """`call` without waiting for the answer on the Ray actor (per-step news costs training nothing)."""
    bound = getattr(controller, method.__name__)
    if _ray_actor(controller) is None:
        bound(*args)
    else:
        bound.remote(*args)


class Polled:
    """`method`'s answer, asked in the background: `latest()` returns the newest answer received (never
    waiting for one; `default` until the first) and asks again; `now()` waits for a fresh one. For
    what a step need not stall on a round trip to the driver for (a progress line, should_stop
    between saves)."""

    def __init__(self, controller, method: Callable, default=None):
        self.controller, self.method, self.value = controller, method, default
        self.pending = None
        self._ask()

    def _ask(self) -> None:
        if _ray_actor(self.controller) is None:
            self.value = getattr(self.controller, self.method.__name__)()
        else:
            self.pending = getattr(self.controller, self.method.__name__).remote()

    def now(self):
        """The answer asked now and waited for."""
        self.value = call(self.controller, self.method)
        return self.value

    def latest(self):
        ray = _ray_actor(self.controller)
        if ray is None:
            self._ask()
        elif ray.wait([self.pending], timeout=0)[0]:
            self.value = ray.get(self.pending)
            self._ask()
        return self.value
