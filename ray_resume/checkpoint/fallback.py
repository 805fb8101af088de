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

from .format import paths
from .io.iterations import check_no_extra_shards, find_committed, iteration_steps, open_iteration
from .root import CheckpointRoot
from .format.schema import Iteration
from ..errors import AbnormalIteration, CheckpointError

logger = logging.getLogger(__name__)


def checked_iteration(root: CheckpointRoot, step: int) -> Iteration:
    """Iteration `step`, its JSON parsed, its listing and shard sizes checked against it: what the
    job resumes, parsed once (a CheckpointError says what is wrong with it)."""
    it = open_iteration(root.storage, root.uri, step)
    check_no_extra_shards(root.storage, it)
    for name, actual in root.storage.sizes(it.path, sorted(it.files)).items():
        listed = it.files[name].size
        if actual != listed:
            path = paths.join(it.path, name)
            raise CheckpointError(
                f"{path}: shard listed in metadata.json is missing"
                if actual is None
                else f"{path}: size is {actual} bytes, metadata.json says {listed}; the shard is truncated or replaced"
            )
    return it


def newest_first(root: CheckpointRoot) -> list[int]:
    return iteration_steps(root.storage, root.uri)[::-1]


def select_iteration(root: CheckpointRoot, *, fallback: bool) -> Iteration | None:
    """The iteration under `root` to load, parsed and checked, or None when nothing was ever committed there."""
    try:
        tracked = find_committed(root.storage, root.uri)
        if tracked is None:
            present = newest_first(root)
            if not present:
                return None
            failure = f"{paths.tracker_path(root.uri)}: missing, but iterations {sorted(present)} are present"
        else:
            try:
                return checked_iteration(root, tracked)
            except CheckpointError as exc:
                failure = exc
    except CheckpointError as exc:  # a garbled tracker, or one naming a missing iteration
        tracked, failure = None, exc
    return fall_back(root, tracked, failure, fallback=fallback)


def fall_back(
    root: CheckpointRoot, damaged: int | None, failure: CheckpointError | str, *, fallback: bool
) -> Iteration:
    """Iteration `damaged` (None: the tracker) cannot be used because of `failure`: the newest older
    iteration that checks out, with `damaged` set aside (never an abnormal one: not damage); or,
    without `fallback`, an error listing them."""
    valid = []
    for step in newest_first(root):
        if damaged is None or step < damaged:
            try:
                valid.append(checked_iteration(root, step))
            except CheckpointError:
                continue
            if fallback:  # the newest is the one
                break
    if not fallback:
        raise CheckpointError(
            f"{failure}. Iterations that check out: {[it.step for it in valid] or 'none'}; set checkpoint.fallback: true to "
            "resume from the newest of them, or repair the damaged one"
        )
    if not valid:
        raise CheckpointError(
            f"{failure}; and no older iteration under {root.uri} checks out, so there is nothing safe to resume"
        )
    chosen = valid[0]
    logger.warning(
        "CHECKPOINT FALLBACK: %s. Resuming from iteration %d instead, the newest older one that checks out.",
        failure,
        chosen.step,
    )
    if damaged is not None and not isinstance(failure, AbnormalIteration):
        set_aside(root, damaged)
    return chosen


def set_aside(root: CheckpointRoot, step: int) -> None:
    storage, src = root.storage, root.iteration_dir(step)
    if not storage.is_dir(src):
        return  # already set aside (by an earlier attempt)
    dst = f"{src}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        storage.rename(src, dst)
        logger.warning("moved the damaged iteration %d aside to %s (not deleted)", step, dst)
    except NotImplementedError:
        logger.warning("left the damaged iteration %d in place at %s: this storage has no rename", step, src)
