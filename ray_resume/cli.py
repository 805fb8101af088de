"""Operator CLI for a checkpoint root: `python -m ray_resume.cli` (or `ray-resume`).

    list    ROOT [--verify] [--json]                  every iteration_* dir, one row each
    verify  ROOT [--iteration N] [--json]             sizes, block digests, extra shards (exit 1 if bad)
    show    ROOT [--iteration N] [--json]             common.json, tensors and their shard pieces
    export  ROOT OUT_DIR [--iteration N] [--with-optimizer] [--rebuild-model] [--force]
                                                      consolidated plain safetensors files
    plot    ROOT -o loss.png                          loss per step over every attempt of the run

Exit status: 0 fine, 1 the checkpoint is not usable (or a command failed),
2 a usage error (bad arguments, missing root, unknown iteration, an output
directory that is not empty). Errors are one `error: ...` line on stderr.

Everything goes through `checkpoint.storage` (never a bare `open()` on a
checkpoint path), and nothing here writes to the checkpoint root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .checkpoint import dcp, paths
from .checkpoint.reader import ShardReader, check_no_extra_shards, iteration_steps, open_iteration, read_tracker
from .checkpoint.root import root_for
from .checkpoint.schema import AbnormalIteration, Iteration, first_row, local_shape, parse_json, readable_by_mindformers
from .checkpoint.storage import Storage
from .errors import CheckpointError
from .text_table import human_size, table

PROG = "ray-resume"


class CliError(Exception):
    """A failure reported as one `error:` line; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise CliError(f"{message} (see `{self.prog} --help`)", 2)


# ----------------------------------------------------------------------------- helpers


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def open_root(root: str) -> Storage:
    """The storage of `root`; a missing root or an unsupported scheme is a usage error."""
    try:
        storage = root_for(root).storage
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    if not storage.is_dir(root):
        raise CliError(f"checkpoint root {root!r} does not exist or is not a directory", 2)
    return storage


def dir_size(storage: Storage, path: str) -> int:
    total = 0
    for name in storage.listdir(path):
        child = paths.join(path, name)
        if storage.is_dir(child):
            total += dir_size(storage, child)
        else:
            total += storage.size(child) or 0
    return total


def resolve_iteration(storage: Storage, root: str, requested: int | None) -> tuple[int, int | None]:
    """(step to inspect, tracker step). Default: the tracker's iteration."""
    tracker = read_tracker(storage, root)  # CheckpointError: garbled tracker -> exit 1
    if requested is not None:
        if requested < 0 or not storage.is_dir(paths.iteration_dir(root, requested)):
            present = ", ".join(map(str, iteration_steps(storage, root))) or "none"
            raise CliError(f"{paths.iteration_dir(root, max(requested, 0))}: no such iteration (iterations here: {present})", 2)
        return requested, tracker
    if tracker is None:
        present = ", ".join(map(str, iteration_steps(storage, root))) or "none"
        raise CliError(
            f"{paths.tracker_path(root)}: missing, so no iteration is committed here "
            f"(iterations present: {present}); pass --iteration N to inspect one anyway"
        )
    if not storage.is_dir(paths.iteration_dir(root, tracker)):
        raise CliError(f"{paths.tracker_path(root)}: names iteration {tracker}, but {paths.iteration_dirname(tracker)}/ does not exist")
    return tracker, tracker


# ----------------------------------------------------------------------------- verification


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
        entry = {"size": f.size, "checksum": f.checksum, "digests": f.digests or [], "kind": f.kind, "rank": f.rank, "ok": False}
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


# ----------------------------------------------------------------------------- list


def describe_iteration(storage: Storage, root: str, step: int, tracker: int | None, verify: bool) -> dict:
    path = paths.iteration_dir(root, step)
    row: dict[str, Any] = {
        "step": step, "path": path, "status": None, "error": None, "tracker": step == tracker, "origin": None,
        "committed": False, "epoch_num": None, "step_num": None, "consumed_samples": None,
        "world_size": None, "global_batch_size": None, "has_optimizer": None, "job_id": None,
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
            it = open_iteration(storage, root, step)
            row.update(status="ok", origin=it.origin, world_size=it.world_size, has_optimizer=it.has_optimizer,
                       job_id=it.ours.get("job_id"))
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


def cmd_list(args) -> int:
    storage = open_root(args.root)
    tracker, tracker_error = None, None
    try:
        tracker = read_tracker(storage, args.root)
    except CheckpointError as exc:
        tracker_error = str(exc)
    rows = [describe_iteration(storage, args.root, s, tracker, args.verify) for s in iteration_steps(storage, args.root)]
    if tracker is not None and not any(r["tracker"] for r in rows):
        tracker_error = f"{paths.tracker_path(args.root)}: names iteration {tracker}, but {paths.iteration_dirname(tracker)}/ does not exist"
    bad = tracker_error is not None or any(r["tracker"] and r["status"] != "ok" for r in rows)
    if args.verify:
        bad = bad or any(r["verified"] is False for r in rows)
    if args.json:
        _emit_json({"root": args.root, "tracker": tracker, "tracker_error": tracker_error, "iterations": rows})
        return 1 if bad else 0
    if not rows:
        print(f"{args.root}: no iteration_* directories")
    else:
        headers = ["step", "epoch_num", "step_num", "consumed", "world", "gbs", "size", "status", "tracker"]
        if args.verify:
            headers.append("verified")
        body = []
        for r in rows:
            mark = "<- tracker" if r["tracker"] else ("not committed" if r["status"] == "ok" and not r["committed"] else "")
            line = [r["step"], r["epoch_num"], r["step_num"], r["consumed_samples"], r["world_size"], r["global_batch_size"],
                    human_size(r["size_bytes"]), r["status"], mark]
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


# ----------------------------------------------------------------------------- verify


def dcp_report(path: str, args, verify: bool) -> int:
    """`show` and `verify` of a DCP checkpoint (`checkpoint.dcp.describe`)."""
    report = dcp.describe(path)
    if args.json:
        _emit_json(report)
    elif not verify:
        print(f"{path}: a torch.distributed.checkpoint (DCP) checkpoint; a job takes its weights (`model.*`)\n")
        print(table(["name", "dtype", "shape", "chunks"], [[n, t["dtype"], t["shape"], t["chunks"]] for n, t in report["tensors"].items()]))
        print(f"\nand {len(report['other'])} entries that are not tensors (param groups, counters)")
    files = f"{len(report['files'])} files, {human_size(sum(f['size'] or 0 for f in report['files'].values()))}"
    if verify and not args.json:
        print(f"OK: {path}: {files}, every item within its file (DCP keeps no digests: the bytes themselves cannot be checked)"
              if report["ok"] else f"FAILED: {path}:\n" + "\n".join(f"  - {p}" for p in report["problems"]))
    return 0 if report["ok"] or not verify else 1


def _dcp_dir(args) -> str | None:
    """The DCP checkpoint ROOT names (its `step-N/` with --iteration N), None if it is not one."""
    return dcp.dcp_checkpoint(args.root if args.iteration is None else os.path.join(args.root, f"step-{args.iteration}"))


def cmd_verify(args) -> int:
    if (dcp_dir := _dcp_dir(args)) is not None:
        return dcp_report(dcp_dir, args, verify=True)
    storage = open_root(args.root)
    step, tracker = resolve_iteration(storage, args.root, args.iteration)
    path, origin = paths.iteration_dir(args.root, step), None
    try:
        it = open_iteration(storage, args.root, step)
        origin = it.origin
        result = verify_iteration(storage, it)
    except CheckpointError as exc:
        result = {"ok": False, "problems": [str(exc)], "files": {}}
    report = {"root": args.root, "iteration": step, "path": path, "tracker": step == tracker, "origin": origin, **result}
    if args.json:
        _emit_json(report)
    else:
        label = f"iteration {step}{' (tracker)' if step == tracker else ''} at {path}"
        if result["files"]:
            print(table(["file", "kind", "rank", "size", "blocks", "ok"],
                        [[n, f["kind"], f["rank"], f["size"], len(f["digests"]), "yes" if f["ok"] else "NO"]
                         for n, f in result["files"].items()], right={2, 3, 4}))
        if result["ok"] and origin == "mindformers":
            total = sum(f["size"] for f in result["files"].values())
            print(f"OK: {label}: {len(result['files'])} files, {human_size(total)}, written by MindFormers: sizes and safetensors "
                  "headers match its metadata (MindFormers keeps no block digests: the bytes themselves cannot be checked)")
        elif result["ok"]:
            total = sum(f["size"] for f in result["files"].values())
            checksums = "/".join(sorted({f["checksum"] for f in result["files"].values()}))
            print(f"OK: {label}: {len(result['files'])} files, {human_size(total)}, sizes and block digests ({checksums}) match metadata.json, "
                  "no extra shards")
        else:
            print(f"FAILED: {label}:")
            for problem in result["problems"]:
                print(f"  - {problem}")
    if not result["ok"]:
        print(f"error: iteration {step} failed verification: {result['problems'][0]}"
              + (f" (and {len(result['problems']) - 1} more)" if len(result["problems"]) > 1 else ""), file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- show


def cmd_show(args) -> int:
    if (dcp_dir := _dcp_dir(args)) is not None:
        return dcp_report(dcp_dir, args, verify=False)
    storage = open_root(args.root)
    step, tracker = resolve_iteration(storage, args.root, args.iteration)
    it = open_iteration(storage, args.root, step)  # CheckpointError -> exit 1
    tensors = []
    for kind, by_name in it.tensors.items():
        for name, stored in by_name.items():
            spec = stored.spec
            tensors.append({"kind": kind, "name": name, "dtype": spec.dtype, "shape": list(spec.shape),
                            "mindformers_readable": readable_by_mindformers(it, kind, name),
                            "chunks": [{"file": file, "first_row": first_row(spec, piece),
                                        "local_shape": list(local_shape(spec, piece)), "start": piece.start, "numel": piece.numel}
                                       for file, piece in stored.pieces]})
    files = {name: {"kind": f.kind, "rank": f.rank, "size": f.size, "data_start": f.data_start, "checksum": f.checksum,
                    "digests": f.digests} for name, f in sorted(it.files.items())}
    if args.json:
        _emit_json({"root": args.root, "iteration": step, "path": it.path, "tracker": step == tracker, "origin": it.origin,
                    "common": it.common, "ray_resume": it.ours, "world_size": it.world_size, "files": files, "tensors": tensors})
        return 0
    by = {"ray_resume": "ray_resume", "mindformers": "MindFormers (no block digests: sizes and headers are what can be checked)"}
    print(f"iteration {step}{' (tracker)' if step == tracker else ''} at {it.path}, written by {by[it.origin]}, {it.world_size} rank(s)")
    print()
    print("common.json")
    print(table(["key", "value"], [[k, json.dumps(v)] for k, v in it.common.items()]))
    if it.ours:
        print()
        print("metadata.json: ray_resume")
        print(table(["key", "value"], [[k, json.dumps(v)[:100]] for k, v in sorted(it.ours.items())]))
    print()
    print("files")
    print(table(["file", "kind", "rank", "size"], [[n, f["kind"], f["rank"], human_size(f["size"])] for n, f in files.items()], right={2, 3}))
    print()
    print("tensors: each chunk is a range of dim-0 rows in one file (metadata.json's global_offset / local_shape);\n"
          "MindFormers' loader places a tensor whole in one file or cut in equal parts (its Layout)")
    rows = []
    for t in tensors:
        for i, chunk in enumerate(t["chunks"] or [None]):
            head = [t["kind"], t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]",
                    "yes" if t["mindformers_readable"] else "NO"] if i == 0 else [""] * 5
            rows.append(head + ([chunk["file"], chunk["first_row"], "[" + ", ".join(map(str, chunk["local_shape"])) + "]"]
                                if chunk else ["-", "", ""]))
    print(table(["kind", "name", "dtype", "shape", "mindformers", "file", "first row", "chunk shape"], rows, right={6}))
    return 0


# ----------------------------------------------------------------------------- export

EXPORT_FILES = ("model.safetensors", "optimizer.safetensors", paths.CONFIG, "config.json")


def cmd_export(args) -> int:
    import safetensors.torch  # heavy: only this command needs it

    from .checkpoint.loader import load_state

    storage = open_root(args.root)
    out = args.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"{out!r} exists and is not a directory", 2)
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        raise CliError(f"output directory {out!r} is not empty; choose an empty one or pass --force to overwrite", 2)
    step, _ = resolve_iteration(storage, args.root, args.iteration)
    it = open_iteration(storage, args.root, step)
    kinds = [paths.MODEL_KIND] + ([paths.OPTIM_KIND] if args.with_optimizer else [])
    if args.with_optimizer and not it.has_optimizer:
        raise CliError(f"{paths.join(it.path, paths.METADATA)}: iteration {step} has no optimizer state (saved with no_save_optim); drop --with-optimizer")
    result = verify_iteration(storage, it)
    if not result["ok"]:
        raise CliError(f"iteration {step} failed verification, nothing exported: " + "; ".join(result["problems"]))
    os.makedirs(out, exist_ok=True)
    for name in EXPORT_FILES:  # --force: no stale file from an earlier export may survive
        if os.path.exists(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    meta = {"format": "pt", "ray_resume_source": it.path, "ray_resume_iteration": str(step)}
    facts, why = export_facts(storage, it, args.rebuild_model)
    hf = facts.get("transformers")
    written = []
    for kind, filename in zip(kinds, ("model.safetensors", "optimizer.safetensors")):
        tensors = load_state(storage, it, kind)
        if kind == paths.MODEL_KIND:
            # The checkpoint stores a tied weight once; a strict load_state_dict wants every name (a copy each).
            tensors.update({alias: tensors[first].clone() for alias, first in facts.get("tied", {}).items() if first in tensors})
            if hf and hf["prefix"]:  # a wrapper's transformers model: its own names, as from_pretrained reads them
                tensors = {n[len(hf["prefix"]):]: t for n, t in tensors.items() if n.startswith(hf["prefix"])}
        safetensors.torch.save_file(tensors, os.path.join(out, filename), metadata=meta)
        os.chmod(os.path.join(out, filename), 0o666 & ~_umask())  # safetensors creates 0600 files
        written.append(f"{filename} ({len(tensors)} tensors, {human_size(os.path.getsize(os.path.join(out, filename)))})")
    config = paths.join(it.path, paths.CONFIG)
    if storage.exists(config):
        with open(os.path.join(out, paths.CONFIG), "wb") as f:
            f.write(storage.read_bytes(config))
        written.append(paths.CONFIG)
    if hf:  # from_pretrained(out) needs its config.json
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(json.dumps(hf["config"], indent=2, sort_keys=True) + "\n")
        written.append(f"config.json ({', '.join(hf['config']['architectures'])}"
                       f"{', the tensors under ' + repr(hf['prefix']) if hf['prefix'] else ''})")
    print(f"exported iteration {step} from {it.path} to {out}: " + ", ".join(written))
    if why:
        print(f"note: {why}")
    return 0


def export_facts(storage, it: Iteration, rebuild: bool) -> tuple[dict, str | None]:
    """What the export needs beyond the tensors (`state.export_facts`: tied names, a transformers
    config), as the iteration's metadata.json holds it since rank 0 took it from the live model; and
    why not, if it could not be had. `rebuild`: for an iteration saved without it (older ray_resume,
    MindFormers), build the model of its config.yaml on the meta device, importing its builder."""
    from .checkpoint import state

    facts = it.ours.get("model")  # checked by schema.parse_ours
    if facts is not None:
        return facts, None
    if not rebuild:
        return {}, ("this iteration was saved without the model's export facts (tied names, a transformers config): "
                    "a tied weight is stored under its first name only, and no config.json is written; "
                    "--rebuild-model builds its model here to find them")
    import torch
    import yaml

    from .config import Config
    from .plugins import make_model, resolve

    try:
        cfg = Config.from_dict(yaml.safe_load(storage.read_bytes(paths.join(it.path, paths.CONFIG))), source=paths.CONFIG)
        with torch.device("meta"):
            return state.export_facts(make_model(resolve(cfg), cfg)), None
    except Exception as exc:  # no config.yaml, a builder not importable here, one that needs real memory...
        return {}, (f"the model was not rebuilt here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                    "a tied weight is stored under its first name only, and no config.json is written")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- plot


def cmd_plot(args) -> int:
    from .plot import PlotError, plot_run

    try:
        summary = plot_run(args.root, args.output)
    except PlotError as exc:
        raise CliError(str(exc), exc.code) from None
    print(f"wrote {summary['output']}: {summary['runs']} run(s), {len(summary['saves'])} save step(s), "
          f"{len(summary['resumes'])} resume(s)" + "".join(f"\n  resumed at step {r['step']} from {r['source']}" for r in summary["resumes"]))
    return 0


# ----------------------------------------------------------------------------- entry


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect, verify and export ray_resume checkpoint roots.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("list", help="one row per iteration_* directory")
    p.add_argument("root", metavar="ROOT", help="checkpoint root (the job's checkpoint.save_path)")
    p.add_argument("--verify", action="store_true", help="also check sizes, block digests and extra shards of every complete iteration")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    for name, func, text in (("verify", cmd_verify, "check one iteration (default: the tracker's); exit 1 if damaged"),
                             ("show", cmd_show, "common.json, every tensor and where its pieces live")):
        p = sub.add_parser(name, help=text)
        p.add_argument("root", metavar="ROOT")
        p.add_argument("--iteration", type=int, default=None, metavar="N", help="iteration step (default: the tracker's)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)

    p = sub.add_parser("export", help="write the consolidated model as plain safetensors")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--iteration", type=int, default=None, metavar="N", help="iteration step (default: the tracker's)")
    p.add_argument("--with-optimizer", action="store_true", help="also write optimizer.safetensors")
    p.add_argument("--rebuild-model", action="store_true",
                   help="only for an iteration saved without the model's export facts (by an older ray_resume, or by MindFormers): "
                        "build the model of its config.yaml on the meta device (this imports its model.builder: only for "
                        "checkpoints you trust) to write tied weights under every name and a Hugging Face config.json")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plot", help="loss per step of every attempt, with saves and resumes marked (needs matplotlib)")
    p.add_argument("root", metavar="ROOT", help="checkpoint root; metrics are read from ROOT-metrics/")
    p.add_argument("-o", "--output", default="loss.png", help="PNG file to write (default: loss.png)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except BrokenPipeError:  # `| head`
        return 0
    except OSError as exc:  # unreadable file, permissions, a full disk on export
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
