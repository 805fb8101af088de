"""README.md and docs/ as a reader follows them: every marked block run, every shown output printed,
every excerpt the file's (tests/doc_examples.py says how blocks are marked); docs/config.md the schema's."""

from __future__ import annotations

import re

import pytest

import doc_examples as ex
from conftest import REPO, env_for_subprocess
from ray_resume.config.reference import markdown

RUN = [doc for doc in ex.DOCS if any(b.kind == "run" for b in ex.blocks(doc))]


@pytest.mark.starts_ray
@pytest.mark.parametrize("doc", RUN, ids=lambda doc: doc.name)
def test_every_example_of_the_document_runs_as_shown(doc, tmp_path, request):
    """The README's first command as a newcomer runs it, starting a Ray of its own; every other example
    joins the suite's Ray instead (RAY_ADDRESS, as under `ray job submit`): a Ray start and stop less
    for each of their jobs, and the same lines printed.
    Its time is the document's: each example a real job, as a reader runs it; a document with fewer jobs is
    the way to a shorter test."""
    readme = doc.name == "README.md"
    request.getfixturevalue("ray_cluster")
    reader = ex.Reader(tmp_path, env_for_subprocess(join_session_ray=not readme))
    reader.follow(doc, then_env=env_for_subprocess(join_session_ray=True) if readme else None)
    assert len(reader.ran) == sum(b.kind == "run" for b in ex.blocks(doc))


def test_every_block_is_marked_and_every_excerpt_is_its_file():
    found = [b for doc in ex.DOCS for b in ex.blocks(doc)]
    assert [b.where for b in found if b.kind == "unmarked"] == []
    for b in found:
        if b.kind == "excerpt":
            ex.excerpt(b)
    assert {"run (bash)", "run (python)", "output", "excerpt"} <= set(ex.tally())


def test_the_runner_fails_on_the_fit_example_the_readme_used_to_show(tmp_path):
    """The README's example of 2026-12-03, the call as it was (its loop cut to nothing): it names
    the mistake a reader copying it met."""
    old = """<!-- run -->
```python
import ray_resume

def train_func(config):
    pass

root = "output/fit"
result = ray_resume.fit(train_func, checkpoint={"save_path": root, "load_path": root, "save_interleaved_steps": 20},
                        scaling={"num_workers": 2}, failure={"max_failures": 2}, train_loop_config={})
```
"""
    with pytest.raises(
        AssertionError, match=re.escape("TypeError: fit() got an unexpected keyword argument 'scaling'")
    ):
        ex.Reader(tmp_path, env_for_subprocess()).follow(REPO / "README.md", text=old)


@pytest.mark.parametrize(
    "shown, holds",
    [
        ("one 1.5 s two\nthree 7 steps\n", True),  # a duration is anything
        ("one … two\n…\nthree 7 steps\n", True),
        ("three 7 steps\none 1.5 s two\n", False),  # order
        ("three 8 steps\n", False),  # any other number is compared
        ("(Worker pid=…) b\n(Worker pid=…) a\n", True),  # two processes' lines in either order
        ("(Worker pid=…) c\n(Worker pid=…) a\n", False),  # one process's in its order
        # Ray ran a process's line onto the end of another's (the raylet's, without its newline): seen
        ("(Worker pid=…) d\n", True),
        ("(raylet) A worker died.\n", True),
    ],
)
def test_an_output_block_holds_only_where_the_run_printed_it(tmp_path, shown, holds):
    printed = (
        "one 0.2 s two\n(Worker pid=1) a\n(Worker pid=2) b\n(Worker pid=1) c\nthree 7 steps\n"
        "(raylet) A worker died.(Worker pid=2) d\n"
    )
    block = ex.Block(REPO / "README.md", 1, "", "output", shown)
    if holds:
        ex.compare(block, printed)
    else:
        with pytest.raises(AssertionError, match="the run did not print"):
            ex.compare(block, printed)


def test_a_block_without_a_marker_fails_naming_its_line(tmp_path):
    with pytest.raises(AssertionError, match=r"blocks without a marker .*README.md:3"):
        ex.Reader(tmp_path, env_for_subprocess()).follow(REPO / "README.md", text="text\n\n```bash\nls\n```\n")


def test_the_configuration_reference_is_what_the_schema_writes():
    assert (REPO / "docs" / "config.md").read_text() == markdown(), (
        "docs/config.md is not the schema's: python -m ray_resume.config reference > docs/config.md"
    )


def test_the_readme_is_a_front_door_and_the_figures_live_in_benchmarks():
    """The README at most 200 lines; benchmark figures (ratios, rates) only in benchmarks/README.md:
    outside the output of their commands and code spans, README.md and docs/ show none."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "benchmarks/README.md" in readme
    for doc in ex.DOCS:
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S))
        figures = re.findall(r"\b\d+(?:\.\d+)?\s?(?:×|x\b|GB/s|MB/s|steps/s|samples/s)", prose)
        assert figures == [], (doc.name, figures)


def _anchors(doc) -> set[str]:
    """The anchors GitHub gives a document's headings (lowercase, punctuation dropped, spaces as hyphens)."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }


def test_every_link_between_the_documents_reaches_its_file_and_heading():
    docs = [*ex.DOCS, REPO / "benchmarks" / "README.md", REPO / "tests" / "README.md", REPO / "cluster" / "README.md"]
    broken = []
    for doc in docs:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert broken == []
