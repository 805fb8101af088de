"""Shared fixtures: one local Ray for in-process jobs, and a tiny job config."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from ray_resume.checkpoint.format import paths
from ray_resume.api import train
from ray_resume.ray_backend import init_local_ray
from ray_resume.metrics import read_metrics  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent
FINAL = 12  # train_steps of tiny_config
STORAGE_SECRETS = {
    "access_key_id": "AKIATESTKEYID0000001",
    "secret_access_key": "s3cr3t/Value+0000000000000000000000000",
    "session_token": "FwoGZXIvYXdzEXAMPLEsessionTOKEN0000000000",
}

# Ray Train's controller polls its workers every 2 s by default: each job would wait up to that
# long to learn that a rank finished or died. Set before any Ray starts, so the session's Ray
# and the drivers started by tests (which inherit this environment) poll 4x as often.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


RAY_VENV_BUILD = pytest.StashKey()


def pytest_sessionstart(session):
    """The oldest admitted Ray's venv (tests/test_ray_range.py) is built from the start, in the background
    beside the tests, by the process that runs the session (xdist's controller, not a worker), and only
    for a run that may reach the test: the whole suite, its file, not the quick loop without Ray."""
    config = session.config
    if os.environ.get("PYTEST_XDIST_WORKER") or "not slow" in (config.option.markexpr or ""):
        return
    here = Path(__file__).resolve().parent
    if any(Path(arg.split("::")[0]).resolve() in (here, REPO, here / "test_ray_range.py") for arg in config.args):
        import test_ray_range

        config.stash[RAY_VENV_BUILD] = test_ray_range.start_building()


def pytest_sessionfinish(session):
    build = session.config.stash.get(RAY_VENV_BUILD, None)
    if build is not None and build.poll() is None:  # the run ended before the test needed it: no venv half made
        os.killpg(build.pid, signal.SIGTERM)
        build.wait()


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group marks as the items are collected
def pytest_collection_modifyitems(items):
    """`slow` is exactly the tests that need a Ray cluster: `pytest -m 'not slow'` runs the rest without one.
    Under pytest-xdist they are one group, run one after another by one process (the session's Ray is
    that process's), beside the rest (pyproject.toml's addopts)."""
    for item in items:
        if "ray_cluster" in item.fixturenames or item.get_closest_marker("starts_ray"):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(autouse=True)
def one_ray_lane(request, tmp_path_factory):
    """Under xdist, the tests with a Ray must all be run by one process (two Rays on one 2-core host
    starve each other, and each sees the other's `ray_current_cluster`): the first claims the lane."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and request.node.get_closest_marker("slow"):
        lane = tmp_path_factory.getbasetemp().parent / "ray-lane"  # the run's, shared by its workers
        with contextlib.suppress(FileExistsError), open(lane, "x") as f:
            f.write(worker)
        if (owner := lane.read_text()) != worker:
            pytest.fail(f"{request.node.nodeid} runs in {worker}, but the tests with a Ray in {owner}: not grouped")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with room for 2 training workers and the Ray Data readers beside them."""
    started = not ray.is_initialized()
    if started:
        dashboard = init_local_ray(num_cpus=4, object_store_memory=300 * 1024**2)
        SESSION_RAY.update(address=ray.get_runtime_context().gcs_address, dashboard=dashboard)
    yield
    if started:
        # A Ray Data iterator closed just before still has threads that finish its batches; one that
        # reaches Ray after ray.shutdown() ends this process (exit 1, no summary). They end in a second or two.
        deadline = time.monotonic() + 10
        while any(t.name == "iter_threaded" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.1)
        ray.shutdown()


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on loopback with a bucket `ckpts`; yields the `checkpoint.storage` options."""
    import s3_server

    server, options = s3_server.start("ckpts")
    yield options
    server.stop()


# the fault most tests inject (faults.Fault's fields): rank 1 killed after step 6, two steps after a save
KILL_AT_6 = {"phase": "after_optimizer_step", "step": 6, "rank": 1}


def tiny_config(tmp: Path, name: str = "tiny", **sections) -> dict:
    """A job small enough for 2 CPU workers in seconds, crossing one epoch boundary.

    160 samples at global batch 16: step 10 finishes epoch 0, so a run of 12
    steps also proves the cursor across epochs. Dropout is on so that exact
    resume depends on the per-rank RNG state in the checkpoint.
    """
    cfg = {
        "name": name,
        "model": {
            "vocab_size": 64,
            "seq_len": 16,
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "dtype": "float32",
            "dropout": 0.1,
        },
        "data": {
            "path": str(tmp / "data"),
            "shuffle": True,
            "seed": 7,
            "synthetic": {"samples": 160, "files": 2, "row_groups_per_file": 3, "seed": 3},
        },
        "training": {
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "train_steps": 12,
            "lr": 1e-3,
            "seed": 42,
            "log_every": 4,
            "log_sample_ids": True,
        },
        "scaling": {"num_workers": 2},
        "failure": {"max_failures": 2},
        # the memory tier off (its default is auto): these jobs resume from their durable saves, as they assert
        "checkpoint": {"save_path": str(tmp / "ckpt"), "save_interleaved_steps": 4, "memory_interleaved_steps": 0},
    }
    for section, values in sections.items():
        if values is None or not isinstance(values, dict):
            cfg[section] = values
        else:
            cfg.setdefault(section, {}).update(values)
    return cfg


def gathered_manifests(root: str, step: int, model_state: dict, optim_state: dict, rank: int, world: int) -> list:
    """This rank's shards of `step` written as a rank writes them (its RNG streams with them), and every
    rank's manifest gathered: what the driver's commit takes (`commit_by_hand`, on rank 0)."""
    import torch.distributed as dist

    from ray_resume.checkpoint.format import state
    from ray_resume.checkpoint.io.storage import LocalStorage
    from ray_resume.checkpoint.io.writer import save_shards

    manifest = save_shards(
        LocalStorage(),
        root,
        step,
        prefix="ckpt",
        rank=rank,
        world_size=world,
        model_state=model_state,
        optim_state=optim_state,
        rank_extras=state.capture_rng(),
    )
    manifests = [None] * world
    dist.all_gather_object(manifests, manifest)
    return manifests


def commit_by_hand(root, step: int, manifests: list, **common) -> dict:
    """The driver's part of a save, for tests that write every rank's shards from one process: the
    real commit (metadata.json, config.yaml, common.json, then the tracker); its metadata."""
    from ray_resume.checkpoint.commit import commit_iteration
    from ray_resume.checkpoint.io.storage import LocalStorage

    common = {
        "global_step": step,
        "global_batch_size": 8,
        "step_num": step,
        "epoch_num": 0,
        "loss_scale": 1.0,
        "consumed_samples": 8 * step,
        **common,
    }
    return commit_iteration(
        LocalStorage(), str(root), step, manifests, common, prefix="ckpt", config={"name": "test"}, job_id="test"
    )


def shard_bytes(root: str | Path, step: int) -> dict[str, bytes]:
    """Every model/opt shard file of one iteration, by name."""
    directory = Path(paths.iteration_dir(str(root), step))
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if paths.parse_shard_filename(p.name)}


def per_step(records: list[dict]) -> dict[int, list[dict]]:
    """For each step, every run of it: [{"loss", "ids" (all ranks, sorted)}], one per (job, attempt)."""
    runs: dict[int, dict[tuple, dict]] = {}
    for r in records:
        if "loss" in r:
            entry = runs.setdefault(r["step"], {}).setdefault((r["job"], r["attempt"]), {"loss": r["loss"], "ids": []})
            entry["ids"] = sorted(entry["ids"] + r["sample_ids"])
    return {step: list(by_run.values()) for step, by_run in sorted(runs.items())}


SESSION_RAY: dict[str, str] = {}  # the `ray_cluster` Ray: its GCS address and dashboard URL


def env_for_subprocess(join_session_ray: bool = False) -> dict:
    """The environment of a process a test starts: this checkout importable; a driver starts a Ray of
    its own unless `join_session_ray`, which sends it to the session's, as `ray job submit` would
    send it to a cluster's (a Ray start and stop less each)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RAY_ADDRESS", None)
    if join_session_ray:
        env.update(RAY_ADDRESS=SESSION_RAY["address"], RAY_API_SERVER_ADDRESS=SESSION_RAY["dashboard"])
    return env


def run_driver(tmp: Path, script: str, *args: str, timeout: float = 600) -> tuple[dict, str]:
    """Run `script`, a driver program of its own (a multi-node Cluster wants the main thread), in a
    process group of its own that is ended after it; its last `RESULT {json}` line, and its output."""
    import subprocess
    import sys

    from test_whole_job import end_group

    driver = tmp / "driver.py"
    driver.write_text(script)
    proc = subprocess.Popen(
        [sys.executable, str(driver), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp,
        start_new_session=True,
        env=env_for_subprocess(),
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        end_group(proc)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-5000:]
    return json.loads(lines[-1][len("RESULT ") :]), out


def run_job(cfg: dict, fault: dict | None = None):
    """Run a job in this process (on the `ray_cluster` Ray), with `fault` injected, and check it committed
    its last step."""
    result = train(cfg, fault=fault)
    assert result.committed_iteration == cfg["training"]["train_steps"]
    return result


class Checked:
    """A backend that runs nothing: what the driver decided once its lease was taken and its checks passed."""

    def run(self, cfg, plan, launch, loop_config: dict):
        self.cfg, self.source = cfg, plan.source
        from ray_resume.controller.job import JobOutcome

        return JobOutcome()


def driver_checks(cfg: dict, **plugins):
    """What the built-in job's driver resolves to resume (a ResumeSource or None), through `train`'s own
    path up to the ranks: a mistake of the user's is raised from here, before any rank would start."""
    checked = Checked()
    train(cfg, backend=checked, **plugins)
    return checked.source


def run_on_harness(cfg: dict, fault: dict | None = None, **plugins):
    """Run a job on the in-process harness (tests/harness.py, no Ray), with `fault` injected, and check it
    committed its last step."""
    import harness

    outcome = harness.run_job(cfg, fault=fault, **plugins)
    assert outcome.error is None and not outcome.driver_killed, outcome
    assert outcome.committed == cfg["training"]["train_steps"]
    return outcome


@pytest.fixture(scope="session")
def reference(ray_cluster, tmp_path_factory):
    """The uninterrupted run on Ray Train that every faulty Ray run is compared with."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = tiny_config(tmp)
    run_job(cfg)
    root = cfg["checkpoint"]["save_path"]
    return {"root": root, "steps": per_step(read_metrics(root)), "data": cfg["data"]["path"]}


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory):
    """The same uninterrupted run on the in-process harness, no Ray: what harness runs are compared
    with (tests/test_harness.py checks that it equals `reference` byte for byte)."""
    tmp = tmp_path_factory.mktemp("local_reference")
    cfg = tiny_config(tmp)
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    return {"root": root, "steps": per_step(read_metrics(root)), "data": cfg["data"]["path"]}


def committed_as(root, step: int) -> tuple[dict, dict]:
    """Iteration `step` as a load sees it (validated, no unlisted shard): what its metadata.json says of
    each file (size and block digests) and its common.json without what differs between two jobs."""
    from ray_resume.checkpoint.io.iterations import check_no_extra_shards, open_iteration
    from ray_resume.checkpoint.io.storage import LocalStorage

    it = open_iteration(LocalStorage(), str(root), step)
    check_no_extra_shards(LocalStorage(), it)
    files = {name: (f.size, f.digests) for name, f in it.files.items()}
    return files, {**it.common, **{k: v for k, v in it.ours.items() if k not in ("job_id", "saved_at")}}


def assert_resumed_once(root, step: int = 4) -> None:
    """The job's first group started at step 0 and its one restart resumed from iteration `step`: the
    fault fired, and a comparison with an uninterrupted twin is not one of two uninterrupted runs."""
    starts = [r for r in read_metrics(str(root)) if r.get("event") == "start" and r["rank"] == 0]
    assert [(r["attempt"], r["step"]) for r in starts] == [(0, 0), (1, step)], starts
    assert starts[1]["source"].endswith(paths.iteration_dirname(step)), starts[1]


def assert_same_as_reference(root, reference) -> list[dict]:
    """Same bytes at every saved iteration, each committed as the reference's was, same loss at every
    step run, before or after a crash."""
    for step in (4, 8, FINAL):
        assert shard_bytes(root, step) == shard_bytes(reference["root"], step), f"iteration {step} differs"
        assert committed_as(root, step) == committed_as(reference["root"], step), (
            f"iteration {step} is committed otherwise"
        )
    assert len(shard_bytes(root, FINAL)) == 4  # model + opt for each of 2 ranks
    common = json.loads((Path(paths.iteration_dir(str(root), FINAL)) / "common.json").read_text())
    assert common["global_step"] == FINAL and common["consumed_samples"] == FINAL * 16
    records = read_metrics(root)
    restarts = [r for r in records if r.get("event") == "start" and r["rank"] == 0]
    steps = per_step(records)
    assert sorted(steps) == list(range(1, FINAL + 1))
    last_resume = restarts[-1]["step"]
    for step, runs in steps.items():
        (expected,) = reference["steps"][step]
        for again in runs:  # a step run before and after the crash gives the same loss and samples
            assert again["loss"] == expected["loss"], f"step {step}: loss {again['loss']} != {expected['loss']}"
            # A killed rank loses the records it had not flushed yet: its share may be missing.
            assert again["ids"] and set(again["ids"]) <= set(expected["ids"]), f"step {step}: sample ids differ"
        if step > last_resume:  # run by the last worker group, which ended normally
            assert runs[-1]["ids"] == expected["ids"], f"step {step}: sample ids of the final run differ"
    return restarts


def pytest_terminal_summary(terminalreporter):
    """Where the docs' examples ran, how many of each kind there are (tests/doc_examples.py)."""
    if any(
        "test_doc_examples" in report.nodeid
        for reports in terminalreporter.stats.values()
        for report in reports
        if hasattr(report, "nodeid")
    ):
        import doc_examples

        terminalreporter.write_line(doc_examples.summary())
