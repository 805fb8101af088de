"""What the commands share: the one-line error, a root opened, an iteration chosen, verified, described."""

from __future__ import annotations

import json
from typing import Any

from ..checkpoint.format import paths
from ..checkpoint.io.reader import ShardReader
from ..checkpoint.io.iterations import check_no_extra_shards
from ..checkpoint.root import CheckpointRoot, root_for
from ..checkpoint.format.schema import Iteration, parse_json
from ..checkpoint.io.storage import Storage
from ..errors import AbnormalIteration, CheckpointError, CliError


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def open_root(uri: str) -> CheckpointRoot:
    """The checkpoint root at `uri`; a missing root or an unsupported scheme is a usage error."""
    try:
        root = root_for(uri)
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    if not root.exists():
        raise CliError(f"checkpoint root {uri!r} does not exist or is not a directory", 2)
    return root


def dir_size(storage: Storage, path: str) -> int:
    total = 0
    for name in storage.listdir(path):
        child = paths.join(path, name)
        if storage.is_dir(child):
            total += dir_size(storage, child)
        else:
            total += storage.size(child) or 0
    return total


def resolve_iteration(checkpoint_root: CheckpointRoot, requested: int | None) -> tuple[int, int | None]:
    """(step to inspect, tracker step). Default: the tracker's iteration."""
    storage, root = checkpoint_root.storage, checkpoint_root.uri
    tracker = checkpoint_root.tracker()  # CheckpointError: garbled tracker -> exit 1
    if requested is not None:
        if requested < 0 or not storage.is_dir(paths.iteration_dir(root, requested)):
            present = ", ".join(map(str, checkpoint_root.steps())) or "none"
            raise CliError(
                f"{paths.iteration_dir(root, max(requested, 0))}: no such iteration (iterations here: {present})", 2
            )
        return requested, tracker
    if tracker is None:
        present = ", ".join(map(str, checkpoint_root.steps())) or "none"
        raise CliError(
            f"{paths.tracker_path(root)}: missing, so no iteration is committed here "
            f"(iterations present: {present}); pass --iteration N to inspect one anyway"
        )
    if not storage.is_dir(paths.iteration_dir(root, tracker)):
        raise CliError(
            f"{paths.tracker_path(root)}: names iteration {tracker}, but {paths.iteration_dirname(tracker)}/ does not exist"
        )
    return tracker, tracker


def verify_iteration(storage: Storage, it: Iteration) -> dict:
    """Check every file metadata.json lists (size, block digests, the pieces its header holds) and look for extra shards.
    A MindFormers iteration has no digests: its files' sizes and headers are checked.

    Streams one file at a time. Returns {"ok", "problems": [str], "files": {name: {...}}};
    every problem names the file it is about.
    """
    problems: list[str] = []
    files: dict[str, dict] = {}
    reader = ShardReader(storage, it)
    for name, f in sorted(it.files.items()):
        entry = {
            "size": f.size,
            "checksum": f.checksum,
            "digests": f.digests or [],
            "kind": f.kind,
            "rank": f.rank,
            "ok": False,
        }
        files[name] = entry
        try:
            reader.read_checked(name, [])
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        entry["ok"] = True
    try:
        check_no_extra_shards(storage, it)
    except CheckpointError as exc:
        problems.append(str(exc))
    return {"ok": not problems, "problems": problems, "files": files}


def describe_iteration(checkpoint_root: CheckpointRoot, step: int, tracker: int | None, verify: bool) -> dict:
    storage, root = checkpoint_root.storage, checkpoint_root.uri
    path = paths.iteration_dir(root, step)
    row: dict[str, Any] = {
        "step": step,
        "path": path,
        "status": None,
        "error": None,
        "tracker": step == tracker,
        "origin": None,
        "committed": False,
        "epoch_num": None,
        "step_num": None,
        "consumed_samples": None,
        "world_size": None,
        "global_batch_size": None,
        "has_optimizer": None,
        "job_id": None,
        "size_bytes": dir_size(storage, path),
    }
    common_file = paths.join(path, paths.COMMON)
    raw: dict = {}
    if storage.exists(common_file):
        try:
            raw = parse_json(storage.read_bytes(common_file), common_file)
        except CheckpointError:
            raw = {}
    for key in ("epoch_num", "step_num", "consumed_samples", "global_batch_size"):
        row[key] = raw.get(key)
    it = None
    if not storage.exists(common_file):
        row["status"] = "incomplete"
        row["error"] = f"{common_file}: missing; this iteration was never committed (or is being rewritten)"
    else:
        try:
            it = checkpoint_root.iteration(step)
            row.update(
                status="ok",
                origin=it.origin,
                world_size=it.world_size,
                has_optimizer=it.has_optimizer,
                job_id=it.ours.get("job_id"),
            )
        except AbnormalIteration as exc:
            row.update(status="abnormal", error=str(exc))
        except CheckpointError as exc:
            row.update(status="invalid", error=str(exc))
    # The tracker names the newest commit; a complete iteration above it was
    # written by a job that died before moving the tracker: never loaded.
    row["committed"] = it is not None and tracker is not None and step <= tracker
    if verify:
        row["verified"] = None
        if it is not None:
            result = verify_iteration(storage, it)
            row["verified"] = result["ok"]
            if not result["ok"]:
                row["error"] = "; ".join(result["problems"])
    return row
