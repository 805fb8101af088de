"""A call to the job's controller or a memory keeper: on its Ray actor, or on the plain object
itself (the tests' harness), the same way. Ranks make them through `controller.client.ControllerClient`.

It imports no Ray (it finds Ray's actor handles only where Ray is loaded), so that the
checkpoint core runs where Ray is not installed (scripts/gpu_check.py on a bare GPU machine).
"""

from __future__ import annotations

import sys

# The calls that change the job's state run one at a time in a concurrency group of their own
# on the actor: queued there behind a slow commit, they hold none of the threads that answer
# the per-step calls (should_stop, last_committed, stepped), however many ranks report.
SERIAL = frozenset({"report", "start_attempt", "claim_fault", "user_failed"})

SAVE_AND_STOP, STOP_NOW = 1, 2  # should_stop's answers, ordered: the ranks agree on the largest


def _ray_actor(controller):
    """Ray, when `controller` is one of its actor handles (none can exist before Ray is imported)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and isinstance(controller, ray.actor.ActorHandle) else None


def call(controller, method: str, *args):
    """Call `method` of the job's controller: remotely on the Ray actor, directly on anything else."""
    ray = _ray_actor(controller)
    if ray is None:
        return getattr(controller, method)(*args)
    remote = getattr(controller, method)
    if method in SERIAL:
        remote = remote.options(concurrency_group="state")
    return ray.get(remote.remote(*args))


def tell(controller, method: str, *args) -> None:
    """`call` without waiting for the answer on the Ray actor (per-step news costs training nothing)."""
    if _ray_actor(controller) is None:
        getattr(controller, method)(*args)
    else:
        getattr(controller, method).remote(*args)


class Polled:
    """`method`'s answer, asked in the background: `latest()` returns the newest answer received (never
    waiting for one; `default` until the first) and asks again; `now()` waits for a fresh one. For
    what a step need not stall on a round trip to the driver for (a progress line, should_stop
    between saves)."""

    def __init__(self, controller, method: str, default=None):
        self.controller, self.method, self.value = controller, method, default
        self.pending = None
        self._ask()

    def _ask(self) -> None:
        if _ray_actor(self.controller) is None:
            self.value = getattr(self.controller, self.method)()
        else:
            self.pending = getattr(self.controller, self.method).remote()

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
