"""The few lines a run ends with: what it did, what its saves and restarts cost, where it stands.

Built on the driver from this job's per-step records (`metrics.read_metrics`)
and what the controller saw of each attempt (the last step rank 0 finished,
and when): records a killed rank had not flushed yet are lost with it, the
controller's account of how far the attempt got is not.
"""

from __future__ import annotations

import statistics

# A restart's parts (the "restart" record rank 0 writes once the lost steps are redone): Ray Train
# noticing the loss, the new worker group up to its first call (where the process's start is
# known: the old group's shutdown and new processes, then their imports and Ray Train's setup),
# model build and restore, the first step (data pipeline start included), and the rest of the
# steps done again.
RESTART_PARTS = (("detect_s", "noticed"), ("new_group_s", "new group"), ("spawn_s", "new processes"),
                 ("setup_s", "imports and setup"), ("restore_s", "build and restore"),
                 ("first_step_s", "first step"), ("redo_s", "redoing"))


def summarize(records: list[dict], attempts: list[dict], *, job_id: str, global_batch_size: int, wall_s: float) -> list[str]:
    """The summary's lines, from this job's `records` and the controller's `attempts`."""
    mine = [r for r in records if r.get("job") == job_id]
    steps = [r for r in mine if r["rank"] == 0 and "loss" in r]
    starts = {r["attempt"]: r for r in mine if r["rank"] == 0 and r.get("event") == "start"}
    if not steps:
        return [f"no step was trained ({wall_s:.1f} s)"]
    first = starts[min(starts)]["step"] if starts else min(r["step"] for r in steps) - 1
    last = max(r["step"] for r in steps)
    done = last - first
    lines = [f"{done} steps ({first + 1}-{last}) in {wall_s:.1f} s: {done * global_batch_size / wall_s:.0f} samples/s overall"]

    stalls = [r["save_stall_s"] for r in mine if "save_stall_s" in r and r.get("event") is None]
    saves = sum(1 for r in steps if r.get("saved"))
    if saves:
        lines.append(f"{saves} saves; training blocked {statistics.mean(stalls):.3f} s per save on average, "
                     f"{max(stalls):.3f} s at most (any rank)")

    parts = {r["attempt"]: r for r in mine if r["rank"] == 0 and r.get("event") == "restart"}
    restarts = []
    for lost, again in zip(attempts, attempts[1:]):
        start = starts.get(again["attempt"])
        if start is None or lost["step"] is None:
            continue
        redone = lost["step"] - start["step"]
        beyond = [r["time"] for r in steps if r["attempt"] == again["attempt"] and r["step"] > lost["step"]]
        cost = f"{min(beyond) - lost['time']:.1f} s" if beyond else "the rest of the run"
        split = parts.get(again["attempt"], {})
        split = ", ".join(f"{label} {split[key]:.1f} s" for key, label in RESTART_PARTS if key in split)
        restarts.append(f"after step {lost['step']}: resumed from {start['step']}, {redone} steps redone, {cost} lost"
                        + (f" ({split})" if split else ""))
    if len(attempts) > 1:
        lines.append(f"{len(attempts) - 1} restart{'s' if len(attempts) > 2 else ''}" + (": " + "; ".join(restarts) if restarts else ""))
    return lines
