"""The few lines a run ends with: what it did, what its saves and restarts cost, where it stands.

Built on the driver from this job's per-step records (`metrics.read_metrics`)
and what the controller saw of each attempt (the last step rank 0 finished,
and when): records a killed rank had not flushed yet are lost with it, the
controller's account of how far the attempt got is not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# What a worker-group start costs, a restart's and the first one's alike: the new group up to its
# first call (where the process's start is known: the old group's shutdown, if any, and Ray Train's
# new processes, then their imports and setup, process group included), model build and restore
# (the data stream's start included), the wait for the first batch, the first step.
GROUP_PARTS = (
    ("new_group_s", "new group"),
    ("spawn_s", "new processes"),
    ("setup_s", "imports and setup"),
    ("restore_s", "build and restore"),
    ("first_batch_s", "first batch"),
    ("first_step_s", "first step"),
)
# A restart's (the "restart" record rank 0 writes once the lost steps are redone): Ray Train noticing
# the loss, the group's parts, and the rest of the steps done again.
RESTART_PARTS = (("detect_s", "noticed"), *GROUP_PARTS, ("redo_s", "redoing"))
# The first start's (the "started" record rank 0 writes after its first step): the driver's checks
# (the lease, the resume source, the data files' footers), Ray's start or join, our actors (the
# controller, the memory tier's keepers), then the group's parts.
START_PARTS = (("checks_s", "checks"), ("ray_s", "Ray"), ("actors_s", "our actors"), *GROUP_PARTS)


def _split(record: dict, parts) -> str:
    """`record`'s parts among `parts`, as the summary says them."""
    return ", ".join(f"{label} {record[key]:.1f} s" for key, label in parts if key in record)


def restart_clock(last: float, noticed: float | None, process_started: float | None, now: float) -> dict:
    """How long a loss took to notice and to replace: from the lost group's last finished step to
    Ray Train's failure report (`detect_s`), from that to the new group's first process
    (`spawn_s`: the old group shut down, new processes), and from that to this call (`setup_s`:
    their imports and Ray Train's setup). A process Ray had started before the loss has no spawn
    time; without `process_started` the two are one, `new_group_s`. The process's start is read on
    its own node's clock, the rest on the driver's: on one machine they are the same clock."""
    clock, since = {}, last
    if noticed is not None:
        clock["detect_s"], since = noticed - last, noticed
    if process_started is None:
        return {**clock, "new_group_s": now - since}
    spawned = min(max(process_started, since), now)
    return {**clock, "spawn_s": spawned - since, "setup_s": now - spawned}


@dataclass(frozen=True)
class Reached:
    """How far a worker-group start got, by the controller's account: the last step rank 0 finished
    (None before one), and when (time.time())."""

    attempt: int
    step: int | None = None
    time: float | None = None


def start_clock(driver: dict, process_started: float | None, now: float) -> dict:
    """The first start's parts up to rank 0's first call, from the driver's stamps (`launched`,
    `checked`, and where Ray Train runs the job `ray_up` and `fit`) and rank 0's process start."""
    clock = {"checks_s": driver["checked"] - driver["launched"]}
    if "fit" in driver:
        clock.update(ray_s=driver["ray_up"] - driver["checked"], actors_s=driver["fit"] - driver["ray_up"])
    return {**clock, **restart_clock(driver.get("fit", driver["checked"]), None, process_started, now)}


def summarize(
    records: list[dict], attempts: list[Reached], *, job_id: str, global_batch_size: int, wall_s: float
) -> list[str]:
    """The summary's lines, from this job's `records` and the controller's `attempts`."""
    mine = [r for r in records if r.get("job") == job_id]
    steps = [r for r in mine if r["rank"] == 0 and "loss" in r]
    starts = {r["attempt"]: r for r in mine if r["rank"] == 0 and r.get("event") == "start"}
    if not steps:
        return [f"no step was trained ({wall_s:.1f} s)"]
    first = starts[min(starts)]["step"] if starts else min(r["step"] for r in steps) - 1
    last = max(r["step"] for r in steps)
    done = last - first
    lines = [
        f"{done} steps ({first + 1}-{last}) in {wall_s:.1f} s: {done * global_batch_size / wall_s:.0f} samples/s overall"
    ]

    started = next((r for r in mine if r["rank"] == 0 and r.get("event") == "started"), None)
    if started:
        total = sum(started[key] for key, _ in START_PARTS if key in started)
        lines.append(f"start: {total:.1f} s to the end of the first step ({_split(started, START_PARTS)})")

    stalls = [r["save_stall_s"] for r in mine if "save_stall_s" in r and r.get("event") is None]
    saves = sum(1 for r in steps if r.get("saved"))
    chosen = next((r["why"] for r in mine if r.get("event") == "async_save_auto"), None)
    if saves:
        lines.append(
            f"{saves} saves; training blocked {statistics.mean(stalls):.3f} s per save on average, "
            f"{max(stalls):.3f} s at most (any rank)"
            + (f"; checkpoint.async_save auto chose {chosen}" if chosen else "")
        )

    parts = {r["attempt"]: r for r in mine if r["rank"] == 0 and r.get("event") == "restart"}
    restarts = []
    for lost, again in zip(attempts, attempts[1:]):
        start = starts.get(again.attempt)
        if start is None or lost.step is None:
            continue
        redone = lost.step - start["step"]
        beyond = [r["time"] for r in steps if r["attempt"] == again.attempt and r["step"] > lost.step]
        cost = f"{min(beyond) - lost.time:.1f} s" if beyond else "the rest of the run"
        split = _split(parts.get(again.attempt, {}), RESTART_PARTS)
        restarts.append(
            f"after step {lost.step}: resumed from {start['step']}, {redone} steps redone, {cost} lost"
            + (f" ({split})" if split else "")
        )
    if len(attempts) > 1:
        lines.append(
            f"{len(attempts) - 1} restart{'s' if len(attempts) > 2 else ''}"
            + (": " + "; ".join(restarts) if restarts else "")
        )
    return lines
