"""Choose the iteration to load when the tracker's one may be damaged.

The tracker's iteration is verified in full (JSON, sizes, the sha256 of
every checksum block, headers, no extra shards). If it fails, or the
tracker itself is missing or garbled while iterations exist, the newest
older iteration that verifies is used, loudly, and a damaged tracked
iteration is renamed aside (never deleted) so the next start does not trip
over it again. `checkpoint.fallback: false` turns this into an error that
lists the iterations that do verify.
"""

from __future__ import annotations

import logging
import time

from . import layout
from .reader import ShardReader, check_no_extra_shards, find_committed, iteration_steps, open_iteration
from .schema import CheckpointError

logger = logging.getLogger(__name__)


def verify(storage, root: str, step: int) -> str | None:
    """None if iteration `step` is complete and intact, else what is wrong with it."""
    try:
        it = open_iteration(storage, root, step)
        check_no_extra_shards(storage, it)
        reader = ShardReader(storage, it)
        for name in sorted(it.metadata["files"]):  # streamed: one block in memory at a time
            reader.read_checked(name, [])
    except (CheckpointError, OSError) as exc:
        return str(exc)
    return None


def newest_first(storage, root: str) -> list[int]:
    return iteration_steps(storage, root)[::-1]


def select_iteration(storage, root: str, *, fallback: bool) -> int | None:
    """The iteration under `root` to load, or None when nothing was ever committed there."""
    try:
        tracked = find_committed(storage, root)
        failure = None if tracked is None else verify(storage, root, tracked)
        if tracked is not None and failure is None:
            return tracked
        if tracked is None:
            present = newest_first(storage, root)
            if not present:
                return None
            failure = f"{layout.tracker_path(root)}: missing, but iterations {sorted(present)} are present"
    except CheckpointError as exc:  # a garbled tracker, or one naming a missing iteration
        tracked, failure = None, str(exc)
    candidates = [s for s in newest_first(storage, root) if tracked is None or s < tracked]
    valid = [s for s in candidates if verify(storage, root, s) is None]
    if not fallback:
        raise CheckpointError(
            f"{failure}. Iterations that verify: {valid or 'none'}; set checkpoint.fallback: true to resume from the newest "
            "of them, or repair the damaged one"
        )
    if not valid:
        raise CheckpointError(f"{failure}; and no older iteration under {root} verifies, so there is nothing safe to resume")
    chosen = valid[0]
    logger.warning("CHECKPOINT FALLBACK: %s. Resuming from iteration %d instead, the newest that verifies.", failure, chosen)
    if tracked is not None:
        set_aside(storage, root, tracked)
    return chosen


def set_aside(storage, root: str, step: int) -> None:
    src = layout.iteration_dir(root, step)
    dst = f"{src}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        storage.rename(src, dst)
        logger.warning("moved the damaged iteration %d aside to %s (not deleted)", step, dst)
    except NotImplementedError:
        logger.warning("left the damaged iteration %d in place at %s: this storage has no rename", step, src)
