"""`list`, `verify`, `show`: what a root holds, checked, without writing to it."""

from __future__ import annotations

import json
import os
import sys

from ..checkpoint.interop import dcp_checkpoint
from ..checkpoint.format import paths
from ..checkpoint.format.schema import first_row, local_shape, readable_by_mindformers
from ..errors import CheckpointError
from ..text_table import human_size, table
from .common import describe_iteration, emit_json, open_root, resolve_iteration, verify_iteration


def cmd_list(args) -> int:
    root = open_root(args.root)
    tracker, tracker_error = None, None
    try:
        tracker = root.tracker()
    except CheckpointError as exc:
        tracker_error = str(exc)
    rows = [describe_iteration(root, s, tracker, args.verify) for s in root.steps()]
    if tracker is not None and not any(r["tracker"] for r in rows):
        tracker_error = f"{paths.tracker_path(args.root)}: names iteration {tracker}, but {paths.iteration_dirname(tracker)}/ does not exist"
    bad = tracker_error is not None or any(r["tracker"] and r["status"] != "ok" for r in rows)
    if args.verify:
        bad = bad or any(r["verified"] is False for r in rows)
    if args.json:
        emit_json({"root": args.root, "tracker": tracker, "tracker_error": tracker_error, "iterations": rows})
        return 1 if bad else 0
    if not rows:
        print(f"{args.root}: no iteration_* directories")
    else:
        headers = ["step", "epoch_num", "step_num", "consumed", "world", "gbs", "size", "status", "tracker"]
        if args.verify:
            headers.append("verified")
        body = []
        for r in rows:
            mark = (
                "<- tracker"
                if r["tracker"]
                else ("not committed" if r["status"] == "ok" and not r["committed"] else "")
            )
            line = [
                r["step"],
                r["epoch_num"],
                r["step_num"],
                r["consumed_samples"],
                r["world_size"],
                r["global_batch_size"],
                human_size(r["size_bytes"]),
                r["status"],
                mark,
            ]
            if args.verify:
                line.append({True: "yes", False: "NO", None: "-"}[r["verified"]])
            body.append(line)
        print(table(headers, body, right={0, 1, 2, 3, 4, 5, 6}))
        for r in rows:
            if r["error"]:
                print(f"  iteration {r['step']}: {r['error']}")
    if tracker is None and tracker_error is None:
        print(f"no tracker ({paths.TRACKER}): nothing under {args.root} is committed")
    if tracker_error:
        print(f"error: {tracker_error}", file=sys.stderr)
    return 1 if bad else 0


def dcp_report(path: str, args, verify: bool) -> int:
    """`show` and `verify` of a DCP checkpoint (`dcp_checkpoint.describe`)."""
    report = dcp_checkpoint.describe(path)
    if args.json:
        emit_json(report)
    elif not verify:
        print(f"{path}: a torch.distributed.checkpoint (DCP) checkpoint; a job takes its weights (`model.*`)\n")
        print(
            table(
                ["name", "dtype", "shape", "chunks"],
                [[n, t["dtype"], t["shape"], t["chunks"]] for n, t in report["tensors"].items()],
            )
        )
        print(f"\nand {len(report['other'])} entries that are not tensors (param groups, counters)")
    files = f"{len(report['files'])} files, {human_size(sum(f['size'] or 0 for f in report['files'].values()))}"
    if verify and not args.json:
        print(
            f"OK: {path}: {files}, every item within its file (DCP keeps no digests: the bytes themselves cannot be checked)"
            if report["ok"]
            else f"FAILED: {path}:\n" + "\n".join(f"  - {p}" for p in report["problems"])
        )
    return 0 if report["ok"] or not verify else 1


def _dcp_dir(args) -> str | None:
    """The DCP checkpoint ROOT names (its `step-N/` with --iteration N), None if it is not one."""
    return dcp_checkpoint.dcp_checkpoint(
        args.root if args.iteration is None else os.path.join(args.root, f"step-{args.iteration}")
    )


def cmd_verify(args) -> int:
    if (dcp_dir := _dcp_dir(args)) is not None:
        return dcp_report(dcp_dir, args, verify=True)
    root = open_root(args.root)
    step, tracker = resolve_iteration(root, args.iteration)
    path, origin = root.iteration_dir(step), None
    try:
        it = root.iteration(step)
        origin = it.origin
        result = verify_iteration(root.storage, it)
    except CheckpointError as exc:
        result = {"ok": False, "problems": [str(exc)], "files": {}}
    report = {
        "root": args.root,
        "iteration": step,
        "path": path,
        "tracker": step == tracker,
        "origin": origin,
        **result,
    }
    if args.json:
        emit_json(report)
    else:
        label = f"iteration {step}{' (tracker)' if step == tracker else ''} at {path}"
        if result["files"]:
            print(
                table(
                    ["file", "kind", "rank", "size", "blocks", "ok"],
                    [
                        [n, f["kind"], f["rank"], f["size"], len(f["digests"]), "yes" if f["ok"] else "NO"]
                        for n, f in result["files"].items()
                    ],
                    right={2, 3, 4},
                )
            )
        if result["ok"] and origin == "mindformers":
            total = sum(f["size"] for f in result["files"].values())
            print(
                f"OK: {label}: {len(result['files'])} files, {human_size(total)}, written by MindFormers: sizes and safetensors "
                "headers match its metadata (MindFormers keeps no block digests: the bytes themselves cannot be checked)"
            )
        elif result["ok"]:
            total = sum(f["size"] for f in result["files"].values())
            checksums = "/".join(sorted({f["checksum"] for f in result["files"].values()}))
            print(
                f"OK: {label}: {len(result['files'])} files, {human_size(total)}, sizes and block digests ({checksums}) match metadata.json, "
                "no extra shards"
            )
        else:
            print(f"FAILED: {label}:")
            for problem in result["problems"]:
                print(f"  - {problem}")
    if not result["ok"]:
        print(
            f"error: iteration {step} failed verification: {result['problems'][0]}"
            + (f" (and {len(result['problems']) - 1} more)" if len(result["problems"]) > 1 else ""),
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_show(args) -> int:
    if (dcp_dir := _dcp_dir(args)) is not None:
        return dcp_report(dcp_dir, args, verify=False)
    root = open_root(args.root)
    step, tracker = resolve_iteration(root, args.iteration)
    it = root.iteration(step)  # CheckpointError -> exit 1
    tensors = []
    for kind, by_name in it.tensors.items():
        for name, stored in by_name.items():
            spec = stored.spec
            tensors.append(
                {
                    "kind": kind,
                    "name": name,
                    "dtype": spec.dtype,
                    "shape": list(spec.shape),
                    "mindformers_readable": readable_by_mindformers(it, kind, name),
                    "chunks": [
                        {
                            "file": file,
                            "first_row": first_row(spec, piece),
                            "local_shape": list(local_shape(spec, piece)),
                            "start": piece.start,
                            "numel": piece.numel,
                        }
                        for file, piece in stored.pieces
                    ],
                }
            )
    files = {
        name: {
            "kind": f.kind,
            "rank": f.rank,
            "size": f.size,
            "data_start": f.data_start,
            "checksum": f.checksum,
            "digests": f.digests,
        }
        for name, f in sorted(it.files.items())
    }
    if args.json:
        emit_json(
            {
                "root": args.root,
                "iteration": step,
                "path": it.path,
                "tracker": step == tracker,
                "origin": it.origin,
                "common": it.common,
                "ray_resume": it.ours,
                "world_size": it.world_size,
                "files": files,
                "tensors": tensors,
            }
        )
        return 0
    by = {
        "ray_resume": "ray_resume",
        "mindformers": "MindFormers (no block digests: sizes and headers are what can be checked)",
    }
    print(
        f"iteration {step}{' (tracker)' if step == tracker else ''} at {it.path}, written by {by[it.origin]}, {it.world_size} rank(s)"
    )
    print()
    print("common.json")
    print(table(["key", "value"], [[k, json.dumps(v)] for k, v in it.common.items()]))
    if it.ours:
        print()
        print("metadata.json: ray_resume")
        print(table(["key", "value"], [[k, json.dumps(v)[:100]] for k, v in sorted(it.ours.items())]))
    print()
    print("files")
    print(
        table(
            ["file", "kind", "rank", "size"],
            [[n, f["kind"], f["rank"], human_size(f["size"])] for n, f in files.items()],
            right={2, 3},
        )
    )
    print()
    print(
        "tensors: each chunk is a range of dim-0 rows in one file (metadata.json's global_offset / local_shape);\n"
        "MindFormers' loader places a tensor whole in one file or cut in equal parts (its Layout)"
    )
    rows = []
    for t in tensors:
        for i, chunk in enumerate(t["chunks"] or [None]):
            head = (
                [
                    t["kind"],
                    t["name"],
                    t["dtype"],
                    "[" + ", ".join(map(str, t["shape"])) + "]",
                    "yes" if t["mindformers_readable"] else "NO",
                ]
                if i == 0
                else [""] * 5
            )
            rows.append(
                head
                + (
                    [chunk["file"], chunk["first_row"], "[" + ", ".join(map(str, chunk["local_shape"])) + "]"]
                    if chunk
                    else ["-", "", ""]
                )
            )
    print(table(["kind", "name", "dtype", "shape", "mindformers", "file", "first row", "chunk shape"], rows, right={6}))
    return 0
