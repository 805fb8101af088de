"""The code blocks of README.md and docs/, run as a reader would run them (tests/test_doc_examples.py).

Every fenced block carries a marker, an HTML comment on the line above it, that says what it is; a
block without one fails the suite, so no example can slip out of it:

    <!-- run -->                 bash: the block runs as a script (`bash -e`); python: as a file
    <!-- output -->              what the `run` block above it prints, compared line by line (below)
    <!-- excerpt of PATH -->     yaml: every key and value in it is in the file at PATH, as written there
    <!-- not run: REASON -->     a block that cannot run here (a cluster's address, a GPU, the suite itself)
    <!-- picture -->             not code: a directory layout, a synopsis with placeholders

A document's `run` blocks run in order in one scratch directory of their own (a later block sees what
an earlier one wrote), beside links to the repository's configs/, examples/ and scripts/, with this
interpreter's bin first on PATH. Two words of the README's first commands are the setup CI has
already done before the suite: `bash scripts/setup.sh [--test] &&` is left out and `.venv/bin/` is
this interpreter's.

An output block is compared with what its run printed, every shown line matching a printed line in
the order shown (within each process: Ray forwards a rank's lines, `(RayTrainWorker pid=…)`, when it
gets to them, so two processes' lines may come in either order). `…` stands for anything,
and so does a duration (a number before ` s`, `s` or ` samples/s`, an `ETA h:mm:ss`): the rest, losses,
steps, bytes and paths' ends, must be what the run printed.

`python tests/doc_examples.py` prints how many blocks of each kind there are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = ("configs", "examples", "scripts")
MARKER = re.compile(r"^<!--\s*(run|output|excerpt of (?P<path>\S+)|not run: (?P<why>.+?)|picture)\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")
SETUP = re.compile(r"bash scripts/setup\.sh( --test)? && ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^(\(\w+ pid=\d+(, ip=[\d.]+)?\) )?")  # a Ray process's line, forwarded
# where a forwarded line starts mid-line: Ray sometimes prints one right after a line of the raylet's
# that lacks its newline ("...OOM killer.(RayTrainWorker pid=7) [fault] killing rank 1 ...")
JOINED = re.compile(r"(?<=\S)(?=\(\w+ pid=\d+(?:, ip=[\d.]+)?\) )")
DURATION = re.compile(r"\d+(?:\.\d+)?(?= ?s\b| samples/s)|\d+:\d\d:\d\d")


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    kind: str  # run | output | excerpt | not run | picture | unmarked
    text: str
    detail: str = ""  # the excerpt's path, the reason it is not run

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(doc: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of `doc` (or of `text`, read as that document), each with its marker."""
    lines = (doc.read_text() if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        kind = (
            "unmarked"
            if marker is None
            else "excerpt"
            if marker["path"]
            else "not run"
            if marker["why"]
            else marker.group(1)
        )
        out.append(
            Block(
                doc,
                i + 1,
                fence.group(1),
                kind,
                "\n".join(lines[i + 1 : end]) + "\n",
                (marker["path"] or marker["why"] or "") if marker else "",
            )
        )
        i = end + 1
    return out


def tally(docs=DOCS) -> Counter:
    """How many blocks of each kind, runs by language."""
    return Counter(f"run ({b.lang})" if b.kind == "run" else b.kind for doc in docs for b in blocks(doc))


def summary(docs=DOCS) -> str:
    """One line: the blocks of each kind, and why those not run are not."""
    count = tally(docs)
    runs = {kind: n for kind, n in count.items() if kind.startswith("run")}
    why = sorted({b.detail for doc in docs for b in blocks(doc) if b.kind == "not run"})
    return (
        f"doc examples in README.md and docs/: {sum(runs.values())} run "
        f"({', '.join(f'{n} {k[5:-1]}' for k, n in sorted(runs.items()))}), {count['output']} outputs compared, "
        f"{count['excerpt']} excerpts checked, {count['not run']} not run ({'; '.join(why)}), {count['picture']} pictures"
        + (f", {count['unmarked']} UNMARKED" if count["unmarked"] else "")
    )


@dataclass
class Reader:
    """One document's reader: a scratch directory, and what the last `run` block printed."""

    scratch: Path
    env: dict
    printed: str = ""
    ran: list[str] = field(default_factory=list)

    def __post_init__(self):
        for name in LINKED:
            if not (self.scratch / name).exists():
                (self.scratch / name).symlink_to(REPO / name)
        self.env = self.with_venv(self.env)

    @staticmethod
    def with_venv(env: dict) -> dict:
        return dict(env, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))

    def follow(self, doc: Path, text: str | None = None, timeout: float = 600, then_env: dict | None = None) -> None:
        """Every block of the document, in order; AssertionError at the first that does not hold. The
        `run` blocks after the first run with `then_env`, where it is given."""
        found = blocks(doc, text)
        unmarked = [b.where for b in found if b.kind == "unmarked"]
        assert not unmarked, f"blocks without a marker (see tests/doc_examples.py): {unmarked}"
        for b in found:
            if b.kind == "run":
                self.run(b, timeout)
                if then_env is not None:
                    self.env, then_env = self.with_venv(then_env), None
            elif b.kind == "output":
                compare(b, self.printed)
            elif b.kind == "excerpt":
                excerpt(b)

    def run(self, b: Block, timeout: float) -> None:
        code = SETUP.sub("", b.text).replace(".venv/bin/", "")
        if b.lang == "python":
            script = self.scratch / f"example_{b.line}.py"
            script.write_text(code)
            args = [sys.executable, str(script)]
        elif b.lang in ("bash", "sh", "shell"):
            args = ["bash", "-e", "-c", code]
        else:
            raise AssertionError(f"{b.where}: a `run` block must be bash or python, not {b.lang or 'unnamed'}")
        proc = subprocess.run(
            args,
            cwd=self.scratch,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        self.printed = ANSI.sub("", proc.stdout)
        self.ran.append(b.where)
        assert proc.returncode == 0, f"{b.where} exited {proc.returncode}:\n{self.printed[-4000:]}"


def compare(b: Block, printed: str) -> None:
    """Each shown line matches a printed one, in order within each process's lines (Ray forwards a
    rank's lines when it gets to them, so lines of two processes may come in either order)."""
    streams: dict[str, list[str]] = {}
    for line in (part for whole in printed.splitlines() for part in JOINED.split(whole)):
        streams.setdefault(PREFIX.match(line).group(), []).append(line.rstrip())
    at = dict.fromkeys(streams, 0)
    for shown in b.text.splitlines():
        if shown.strip() in ("", "…"):
            continue
        pattern = _pattern(shown.rstrip())
        hit = next(
            (
                (key, i)
                for key, lines in streams.items()
                for i in range(at[key], len(lines))
                if pattern.fullmatch(lines[i])
            ),
            None,
        )
        assert hit is not None, (
            f"{b.where}: the run did not print, in this order,\n  {shown}\n"
            f"it printed:\n" + "\n".join(printed.splitlines()[-60:])
        )
        at[hit[0]] = hit[1] + 1


def _pattern(shown: str) -> re.Pattern:
    parts, last = [], 0
    for m in re.finditer(r"…|" + DURATION.pattern, shown):
        parts += [re.escape(shown[last : m.start()]), ".*?" if m.group() == "…" else r"[\d.:]+"]
        last = m.end()
    return re.compile("".join(parts) + re.escape(shown[last:]))


def excerpt(b: Block) -> None:
    """Every key and value of the block is the file's, at the same place."""
    whole = yaml.safe_load((REPO / b.detail).read_text())

    def inside(part, of, where):
        if isinstance(part, dict):
            assert isinstance(of, dict), f"{b.where}: {where or 'the block'} is a mapping, in {b.detail} it is {of!r}"
            for key, value in part.items():
                assert key in of, f"{b.where}: {b.detail} has no {where}{key}"
                inside(value, of[key], f"{where}{key}.")
        else:
            assert part == of, f"{b.where}: {where.rstrip('.')} is {part!r} here and {of!r} in {b.detail}"

    inside(yaml.safe_load(b.text), whole, "")


if __name__ == "__main__":
    print(summary())
