"""Operator CLI for a checkpoint root: `python -m ray_resume.cli` (or `ray-resume`), its commands in
`reports.py` and `export.py`.

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
import sys

from ..errors import CheckpointError, CliError
from .export import cmd_export
from .reports import cmd_list, cmd_show, cmd_verify


PROG = "ray-resume"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise CliError(f"{message} (see `{self.prog} --help`)", 2)


def cmd_plot(args) -> int:
    from ..plot import plot_run

    summary = plot_run(args.root, args.output)
    print(
        f"wrote {summary['output']}: {summary['runs']} run(s), {len(summary['saves'])} save step(s), "
        f"{len(summary['resumes'])} resume(s)"
        + "".join(f"\n  resumed at step {r['step']} from {r['source']}" for r in summary["resumes"])
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect, verify and export ray_resume checkpoint roots.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("list", help="one row per iteration_* directory")
    p.add_argument("root", metavar="ROOT", help="checkpoint root (the job's checkpoint.save_path)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also check sizes, block digests and extra shards of every complete iteration",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    for name, func, text in (
        ("verify", cmd_verify, "check one iteration (default: the tracker's); exit 1 if damaged"),
        ("show", cmd_show, "common.json, every tensor and where its pieces live"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("root", metavar="ROOT")
        p.add_argument(
            "--iteration", type=int, default=None, metavar="N", help="iteration step (default: the tracker's)"
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)

    p = sub.add_parser("export", help="write the consolidated model as plain safetensors")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--iteration", type=int, default=None, metavar="N", help="iteration step (default: the tracker's)")
    p.add_argument("--with-optimizer", action="store_true", help="also write optimizer.safetensors")
    p.add_argument(
        "--rebuild-model",
        action="store_true",
        help="only for an iteration saved without the model's export facts (by an older ray_resume, or by MindFormers): "
        "build the model of its config.yaml on the meta device (this imports its model.builder: only for "
        "checkpoints you trust) to write tied weights under every name and a Hugging Face config.json",
    )
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
