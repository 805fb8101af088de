"""Choose the iteration to load when the tracker's one may be damaged.

The driver checks what it can without reading shard bytes: the tracker,
common.json and metadata.json (parsed and consistent with the directory),
every listed shard's size (one listing) and no unlisted shards. The bytes
are verified by the ranks that load them (every checksum block is read and
checked by exactly one rank). Damage found either way falls back the same
way: the newest older iteration whose metadata checks out is used, loudly,
and the damaged one is renamed aside (never deleted) so the next start does
not trip over it again. `checkpoint.fallback: false` turns this into an
error that lists the iterations that do check out.

A storage error (OSError: EIO, a timeout, a 5xx) is not damage: it is raised,
and nothing is set aside because a read failed. Nor is an iteration whose
common.json says `ckpt_status` 1 (abnormal, as MindFormers marks one): it is
passed over for an older one, as MindFormers' own loader does, and left where it is.
"""

from __future__ import annotations

import logging
import time

from . import paths
from .reader import check_no_extra_shards, find_committed, iteration_steps, open_iteration
from .schema import AbnormalIteration
from ..errors import CheckpointError

logger = logging.getLogger(__name__)


def check_metadata(storage, root: str, step: int) -> CheckpointError | None:
    """None if iteration `step`'s JSON, listing and shard sizes are intact, else what is wrong with it."""
    try:
        it = open_iteration(storage, root, step)
        check_no_extra_shards(storage, it)
        sizes = storage.sizes(it.path, sorted(it.files))
        for name, actual in sizes.items():
            listed = it.files[name].size
            if actual != listed:
                path = paths.join(it.path, name)
                return CheckpointError(f"{path}: shard listed in metadata.json is missing" if actual is None else
                                       f"{path}: size is {actual} bytes, metadata.json says {listed}; the shard is truncated or replaced")
    except CheckpointError as exc:
        return exc
    return None


def newest_first(storage, root: str) -> list[int]:
    return iteration_steps(storage, root)[::-1]


def select_iteration(storage, root: str, *, fallback: bool) -> int | None:
    """The iteration under `root` to load, or None when nothing was ever committed there."""
    try:
        tracked = find_committed(storage, root)
        failure = None if tracked is None else check_metadata(storage, root, tracked)
        if tracked is not None and failure is None:
            return tracked
        if tracked is None:
            present = newest_first(storage, root)
            if not present:
                return None
            failure = f"{paths.tracker_path(root)}: missing, but iterations {sorted(present)} are present"
    except CheckpointError as exc:  # a garbled tracker, or one naming a missing iteration
        tracked, failure = None, exc
    return fall_back(storage, root, tracked, failure, fallback=fallback)


def fall_back(storage, root: str, damaged: int | None, failure: CheckpointError | str, *, fallback: bool) -> int:
    """Iteration `damaged` (None: the tracker) cannot be used because of `failure`: the newest older
    iteration that checks out, with `damaged` set aside (never an abnormal one: not damage); or,
    without `fallback`, an error listing them."""
    candidates = [s for s in newest_first(storage, root) if damaged is None or s < damaged]
    valid = [s for s in candidates if check_metadata(storage, root, s) is None]
    if not fallback:
        raise CheckpointError(
            f"{failure}. Iterations that check out: {valid or 'none'}; set checkpoint.fallback: true to resume from the "
            "newest of them, or repair the damaged one"
        )
    if not valid:
        raise CheckpointError(f"{failure}; and no older iteration under {root} checks out, so there is nothing safe to resume")
    chosen = valid[0]
    logger.warning("CHECKPOINT FALLBACK: %s. Resuming from iteration %d instead, the newest older one that checks out.", failure, chosen)
    if damaged is not None and not isinstance(failure, AbnormalIteration):
        set_aside(storage, root, damaged)
    return chosen


def set_aside(storage, root: str, step: int) -> None:
    src = paths.iteration_dir(root, step)
    if not storage.is_dir(src):
        return  # already set aside (by an earlier attempt)
    dst = f"{src}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        storage.rename(src, dst)
        logger.warning("moved the damaged iteration %d aside to %s (not deleted)", step, dst)
    except NotImplementedError:
        logger.warning("left the damaged iteration %d in place at %s: this storage has no rename", step, src)
