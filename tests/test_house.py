"""The layout of ray_resume/ (docs/architecture.md): modules in layers, nothing importing a module above
its own, no import circle, no module over 400 lines; and what the layout promises at run time."""

from __future__ import annotations

import ast
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from conftest import KILL_AT_6, REPO, driver_checks, run_on_harness, tiny_config
from ray_resume.checkpoint import root as root_module
from ray_resume.checkpoint.io.lease import LEASE_DIR, Lease
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.errors import CheckpointError

PACKAGE = REPO / "ray_resume"
# Bottom to top; a module may import its own layer's and those below (docs/architecture.md).
LAYERS = [
    ["errors", "calls", "faults", "model", "summary", "text_table", "collectives", "wire", "checkpoint"],
    # checkpoint/'s rooms: the format knows no I/O; the I/O moves the format's bytes; other formats and the
    # orchestration (a rank's save and restore, the commit, fallback, memory tier, root) use both
    ["checkpoint.format"],
    ["checkpoint.io"],
    [
        "checkpoint.interop",
        "checkpoint.checkpointer",
        "checkpoint.restore",
        "checkpoint.async_choice",
        "checkpoint.loader",
        "checkpoint.commit",
        "checkpoint.fallback",
        "checkpoint.memory",
        "checkpoint.keeper",
        "checkpoint.root",
    ],
    ["config", "data", "metrics", "optim", "parallel", "plugins", "extra_state", "plot"],
    ["controller"],
    ["rank", "progress", "train_loop"],
    ["preflight", "driver", "ray_backend"],
    ["api"],
    ["run", "cli"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        out[name.removesuffix(".__init__").removesuffix("__init__")] = path
    return out


def layer_of(module: str) -> int | None:
    """A module's layer: its own entry, else its package's (config.words is config's)."""
    while module:
        if module in LAYER:
            return LAYER[module]
        module = module.rpartition(".")[0]
    return None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, anywhere in it (a function's import counts too): every
    name of an import, each as the nearest module it is or is in (`from .x import Name` is `x`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".") if package else []
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("ray_resume"):
                target = node.module.removeprefix("ray_resume").lstrip(".")
            else:
                continue
            candidates = [f"{target}.{a.name}".lstrip(".") for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [
                a.name.removeprefix("ray_resume").lstrip(".") for a in node.names if a.name.startswith("ray_resume")
            ]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


def import_map() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items() if name}


def test_every_module_has_a_layer_and_imports_none_above_it():
    graph = import_map()
    assert [m for m in graph if layer_of(m) is None] == []
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if d and layer_of(d) > layer_of(m))
    assert upward == []


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    """The lint and the format pyproject.toml configures, over the repository, as part of the suite (so
    CI runs them): `ruff format .` writes what the format check wants."""
    import subprocess
    import sys

    found = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", str(REPO)], capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout + found.stderr


def test_the_import_scanner_reads_every_name_of_an_import(tmp_path):
    """`from . import a, b` imports b too: an upward import in second place is found."""
    module = tmp_path / "low.py"
    module.write_text(
        "from . import paths\nfrom .. import errors, driver\nfrom .root import root_for, CheckpointRoot\n"
    )
    known = {name: tmp_path for name in ("checkpoint", "checkpoint.paths", "checkpoint.root", "errors", "driver")}
    assert imports("checkpoint.low", module, known) == {"checkpoint.paths", "errors", "driver", "checkpoint.root"}


def test_the_import_map_has_no_circle():
    graph = import_map()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path + [m, d]
            if d not in state and (found := visit(d, path + [m])):
                return found
        state[m] = 2
        return None

    circles = [c for m in sorted(graph) if m not in state and (c := visit(m, []))]
    assert circles == []


def test_no_module_is_over_400_lines():
    assert {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 400} == {}


@pytest.mark.parametrize("module", ["controller.job", "checkpoint.root", "checkpoint.commit", "checkpoint.keeper"])
def test_the_job_controller_the_keepers_and_what_they_read_load_no_torch(module):
    """Every job starts a controller actor and, with the memory tier, a keeper per node: processes of
    their own. torch there was seconds of a core per job for nothing (they commit JSON, read metadata
    and hold snapshots, never a tensor)."""
    import subprocess
    import sys

    code = f"import sys, ray_resume.{module}; print([m for m in ('torch', 'safetensors.torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_every_call_to_an_actor_names_its_method_by_its_function():
    """`calls.call(handle, JobController.report, ...)`, never `"report"`: a method renamed or mistyped
    fails where the call is written. `calls.serial` marks the controller's methods that change the job's
    state (the actor's "state" group); the per-step ones stay off it."""
    from ray_resume.calls import call
    from ray_resume.controller import JobController

    by_string = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("call", "tell", "Polled")
        and any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[1:2])
    ]
    assert by_string == []
    serial = {name for name in dir(JobController) if getattr(getattr(JobController, name), "serial", False)}
    assert serial == {"report", "start_attempt", "claim_fault", "user_failed"}

    class Plain:
        def report(self, x):
            return x + 1

    assert call(Plain(), JobController.report, 1) == 2
    with pytest.raises(AttributeError):
        call(Plain(), "report", 1)


@pytest.mark.invariant(15)
def test_the_package_reaches_nothing_private_of_ray():
    """Ray's public surface only (`ray._private`, `ray._raylet`, any `_internal` module, by import or by
    name, as a logger's): what is below it changes between minors, and the requirement is a range."""
    import re

    private = re.compile(r"ray\._|_internal")
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


def test_every_import_of_the_tests_and_benchmarks_is_declared_by_an_extra():
    """`pip install -e .[test]` (or `.[bench]`) brings whatever the suite (or a benchmark) imports: a
    package that only arrives with another (psutil with MindSpore) is named in pyproject.toml too."""
    import importlib.metadata
    import re
    import sys
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        for requirement in project["dependencies"] + sum(project["optional-dependencies"].values(), [])
    }
    declared.add("mindformers")  # scripts/setup.sh installs it (--no-deps; see the mindformers extra)
    ours = {path.stem for folder in ("tests", "benchmarks", "scripts") for path in (REPO / folder).glob("*.py")}
    ours |= {"ray_resume", "benchmarks", "examples"}
    distributions = importlib.metadata.packages_distributions()
    undeclared = set()
    for folder in ("tests", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and not node.level
                    else []
                )
                for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - ours:
                    found = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
                    if not found & declared:
                        undeclared.add(f"{path.relative_to(REPO)}: {top} ({', '.join(sorted(found))})")
    assert sorted(undeclared) == []


@pytest.mark.invariant(9, 13)
def test_a_second_job_on_a_held_root_leaves_it_exactly_as_it_was(tmp_path, local_reference):
    """Another job holds the root's lease, and its newest iteration is damaged (a truncated shard): a
    second start is refused by the lease before it reads anything for writing. Before, its resume
    source was resolved ahead of the lease, and the damaged iteration was renamed aside in a root
    another job owned."""
    root = tmp_path / "ckpt"
    shutil.copytree(local_reference["root"], root)
    shard = sorted((root / "iteration_00000012").glob("*-model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    holder = Lease(LocalStorage(), str(root), "the-holder", ttl_s=600)
    holder.acquire()
    before = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(root)})
    cfg["data"]["path"] = local_reference["data"]
    try:
        with pytest.raises(CheckpointError, match=f"checkpoint.save_path '{root}' is being written by job the-holder"):
            driver_checks(cfg)
    finally:
        after = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        holder.release()
    assert after == before  # the damaged iteration where it was, the holder's lease untouched
    assert (root / LEASE_DIR).is_dir() and json.loads(next((root / LEASE_DIR).iterdir()).read_text())[
        "job_id"
    ] == "the-holder"


@pytest.mark.invariant(2)
def test_each_process_builds_a_roots_storage_once(tmp_path, local_reference, monkeypatch):
    """A job that resumes its own root, with a rank killed (so two worker groups): the driver, the
    controller, every rank process and its writer process each build that root's storage once, whatever reads or writes
    it (the lease, the checks, commits, retention, shards, restores, metrics)."""
    import storage_faults

    built_here = Counter()
    real = root_module.storage_for
    monkeypatch.setattr(
        root_module, "storage_for", lambda uri, options=None: built_here.update([uri]) or real(uri, options)
    )
    record = str(tmp_path / "builds.jsonl")
    cfg = tiny_config(
        tmp_path,
        checkpoint={"load_path": str(tmp_path / "ckpt"), "async_writer": "process"},
    )
    cfg["data"]["path"] = local_reference["data"]
    assert run_on_harness(cfg, KILL_AT_6, storage_faults=([], record)).attempts == 2
    assert built_here == {str(tmp_path / "ckpt"): 1}
    by_process = Counter((b["built"], b["writer"]) for b in storage_faults.builds(record))
    assert set(by_process.values()) == {1}, by_process
    # the controller and 2 ranks of each of 2 groups, and each rank's writer process
    assert sum(not writer for _, writer in by_process) == 5, by_process
    assert sum(writer for _, writer in by_process) == 4, by_process
    assert os.getpid() not in {pid for pid, _ in by_process}  # the driver is counted above


def count_parses(record: str, patch=setattr) -> None:
    """Every name in ray_resume bound to `parse_iteration` (each parse of an iteration's JSON) made
    to append this process's pid and the step to `record` first."""
    import sys

    from ray_resume.checkpoint.format import parse

    real = parse.parse_iteration

    def counted(raw, root, step):
        with open(record, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "step": step}) + "\n")
        return real(raw, root, step)

    for name, module in list(sys.modules.items()):
        if name.startswith("ray_resume"):
            for attr, value in list(vars(module).items()):
                if value is real:
                    patch(module, attr, counted)


def test_each_process_parses_the_iteration_it_resumes_once(tmp_path, local_reference, monkeypatch):
    """A job that resumes iteration 8 of another run: the driver (its checks, its fallback's) and every
    rank (rank 0 reads and broadcasts it) each parse its JSON once; the controller not at all."""
    first = tiny_config(tmp_path, training={"train_steps": 8})
    first["data"]["path"] = local_reference["data"]
    run_on_harness(first)
    record = str(tmp_path / "parses.jsonl")
    count_parses(record, monkeypatch.setattr)
    cfg = tiny_config(
        tmp_path, checkpoint={"load_path": first["checkpoint"]["save_path"], "save_path": str(tmp_path / "again")}
    )
    cfg["data"]["path"] = local_reference["data"]
    run_on_harness(cfg, setup=(count_parses, record))
    with open(record) as f:
        parses = Counter(r["pid"] for r in map(json.loads, f) if r["step"] == 8)
    assert parses.pop(os.getpid()) == 1  # the driver
    assert list(parses.values()) == [1, 1], parses  # rank 0 and rank 1
