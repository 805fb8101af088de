"""A group's processes, the first and a restarted one, are forks of the node's fork server, which
imported what a rank imports once (ray_resume.forkserver): on a real `fit()`, and the protocol on
its own with real processes (a stand-in for Ray's worker script)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

import ray_resume
from ray_resume import forkserver
from ray_resume.errors import ConfigError

STEPS = 4


def train_func(config: dict) -> None:
    """Each rank says its pid and its parent; on the first attempt rank 1 says whether its node's
    fork server serves and is SIGKILLed."""
    import ray.train

    ctx = ray.train.get_context()
    rank, out = ctx.get_world_rank(), Path(config["dir"])
    ck = ray_resume.get_checkpointer()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt = "restarted" if (out / "killed.json").exists() else "first"
    (out / f"{attempt}-{rank}.json").write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid()}))
    start = ck.restore(model, opt)
    for step in range(start.step + 1, STEPS + 1):
        torch.distributed.all_reduce(torch.ones(1))  # rank 0 waits here for the lost rank 1
        if attempt == "first" and step == 2 and rank == 1:
            (out / "killed.json").write_text(json.dumps({"serving": forkserver.serving(), "at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        ck.maybe_save(step, consumed_samples=step, global_batch_size=1)


@pytest.fixture
def by_value():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:  # gone
        return ""


@pytest.mark.usefixtures("ray_cluster", "by_value")
def test_both_groups_run_in_forks_of_the_fork_server(tmp_path):
    """By default (`failure.fork_server: auto`), on CPU ranks too: the first group's processes and
    the restarted group's new ones are forks of one server on the node."""
    import ray.train

    result = ray_resume.fit(train_func, train_loop_config={"dir": str(tmp_path)},
                            checkpoint={"save_path": str(tmp_path / "root"), "save_interleaved_steps": 1},
                            scaling_config=ray.train.ScalingConfig(num_workers=2), failure_config={"max_failures": 1})
    assert result.committed_iteration == STEPS
    assert json.loads((tmp_path / "killed.json").read_text())["serving"] is True
    first, restarted = ([json.loads((tmp_path / f"{attempt}-{rank}.json").read_text()) for rank in range(2)]
                        for attempt in ("first", "restarted"))
    assert len({r["parent"] for r in first + restarted}) == 1, (first, restarted)  # one server for the node
    assert f"-m {forkserver.MODULE} --serve" in command_line(restarted[0]["parent"])
    assert not {r["pid"] for r in restarted} & {r["pid"] for r in first}, (first, restarted)  # new processes


WORKER = textwrap.dedent("""
    import json, os, sys, time
    print("hello from the worker", flush=True)
    imported = {name: name in sys.modules for name in ("torch", "ray.train.torch", "ray_resume.rank")}
    import ray.train
    from ray._raylet import ObjectID
    json.dump({"pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
               "mine": os.environ.get("MY_VAR"), "imported": imported,
               "ray_id": ObjectID.from_random().hex()}, open(f"report{os.environ.get('NTH', '')}.json", "w"))
    if "--wait" in sys.argv:
        time.sleep(120)
    sys.exit(7)
""")


def job_env(tmp_path: Path) -> tuple[dict, list[str], str]:
    """A made-up job of this test's process (its raylet), the stand-in worker script's arguments and
    its server's address."""
    env = {**os.environ, "RAY_JOB_ID": f"job-{os.getpid()}-{time.monotonic_ns()}", "RAY_RAYLET_PID": str(os.getpid())}
    (tmp_path / "worker.py").write_text(WORKER)
    argv = [str(tmp_path / "worker.py"), "--runtime-env-hash=42"]
    return env, argv, forkserver._address(argv, env)


PRELOAD = "--preload=ray_resume.rank"  # what our driver names (and ray_resume.driver)


def until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture
def server(tmp_path):
    """A fork server, told to import, for a made-up job whose one other process here is a `sleep`
    (the server ends 1 s after the job's last process)."""
    env, argv, address = job_env(tmp_path)
    job_process = subprocess.Popen(["sleep", "600"], env=env)
    proc = subprocess.Popen([sys.executable, "-m", forkserver.MODULE, "--serve", address, "--idle=1", PRELOAD], env=env)
    until(lambda: forkserver._serving(address), "the server serves")
    yield proc, env, argv, job_process
    for p in (proc, job_process):
        p.kill()
        p.wait()


def run_client(env: dict, argv: list[str], cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", forkserver.MODULE, PRELOAD, *argv, *extra], env={**env, "MY_VAR": "x"},
                            cwd=cwd, stdout=subprocess.PIPE, text=True)


def report(cwd: Path, nth: str = "", timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads((cwd / f"report{nth}.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError("the worker wrote no report")


def test_without_a_server_a_client_starts_one_and_runs_the_worker_in_a_fork_of_it(tmp_path):
    env, argv, address = job_env(tmp_path)
    client = run_client(env, argv, tmp_path)
    out, _ = client.communicate(timeout=120)
    got = report(tmp_path)
    server = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and address in command_line(int(p.name)))
    try:
        assert (client.returncode, out) == (7, "hello from the worker\n")
        assert got["parent"] == server and got["pid"] != client.pid
        assert got["imported"] == {"torch": True, "ray.train.torch": True, "ray_resume.rank": True}  # by the server
    finally:
        os.kill(server, signal.SIGKILL)


def test_a_client_gone_while_the_server_imports_leaves_it_serving_the_next(tmp_path):
    """Ray may end a process it started while the server is still importing (a job cancelled as it
    starts): the server forks for it anyway, the fork ends with its client, and the server serves on."""
    env, argv, address = job_env(tmp_path)
    job_process = subprocess.Popen(["sleep", "600"], env=env)
    server = subprocess.Popen([sys.executable, "-m", forkserver.MODULE, "--serve", address, "--idle=1", PRELOAD], env=env)
    ended = subprocess.Popen(["true"])  # a client that has ended
    ended.wait()
    (tmp_path / "gone").mkdir()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            until(lambda: gone.connect_ex("\0" + address) == 0, "the server listens")
            forkserver._send(gone, {"fork": {"argv": argv, "env": env, "cwd": str(tmp_path / "gone"), "client": ended.pid}},
                             [0, 1, 2])
        client = run_client(env, argv, tmp_path)
        out, _ = client.communicate(timeout=120)
        assert (client.returncode, out, report(tmp_path)["parent"]) == (7, "hello from the worker\n", server.pid)
    finally:
        for p in (server, job_process):
            p.kill()
            p.wait()


def test_a_client_the_server_cannot_serve_runs_the_worker_itself(tmp_path):
    """A server that closes the connection (as ours does where it cannot fork safely)."""
    env, argv, address = job_env(tmp_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as refusing:
        refusing.bind("\0" + address)
        refusing.listen(1)
        client = run_client(env, argv, tmp_path)
        refusing.accept()[0].close()
        out, _ = client.communicate(timeout=60)
    assert (client.returncode, out, report(tmp_path)["pid"]) == (7, "hello from the worker\n", client.pid)


def test_a_client_runs_the_worker_in_a_fork_of_the_server_in_its_own_environment(server, tmp_path):
    """A connection that leaves without a word first does not end the server."""
    proc, env, argv, _ = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect("\0" + forkserver._address(argv, env))
    client = run_client(env, argv, tmp_path, "a b")
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 7  # the worker's exit code
    assert out == "hello from the worker\n"  # its stdout is the client's
    got = report(tmp_path)
    assert got["parent"] == proc.pid and got["pid"] != client.pid
    assert got["imported"] == {"torch": True, "ray.train.torch": True, "ray_resume.rank": True}  # by the server
    assert (got["cwd"], got["argv"], got["mine"]) == (str(tmp_path), [*argv, "a b"], "x")


def test_forks_of_the_server_draw_distinct_ray_ids(server, tmp_path):
    """Ray's random IDs (objects, tasks) come from a generator whose state forks share once it has
    been drawn from, and importing Ray Train draws (its module-level actor classes): two forks that
    drew the same IDs died in Ray's object store warm-up."""
    _, env, argv, _ = server
    clients = [run_client({**env, "NTH": str(n)}, argv, tmp_path) for n in range(2)]
    for client in clients:
        client.communicate(timeout=60)
    ids = [report(tmp_path, str(n))["ray_id"] for n in range(2)]
    assert ids[0] != ids[1], ids


def test_the_worker_ends_with_its_client_and_the_client_with_its_worker(server, tmp_path):
    """Ray's signals reach the worker; a SIGKILLed client (Ray may kill the process it started)
    takes the worker with it; a SIGKILLed worker ends its client with the same signal; the server
    ends once no process of its job is left."""
    proc, env, argv, job_process = server
    for cause in ("SIGTERM to the client", "SIGKILL to the client", "SIGKILL to the worker"):
        (tmp_path / "report.json").unlink(missing_ok=True)
        client = run_client(env, argv, tmp_path, "--wait")
        worker = report(tmp_path)["pid"]
        os.kill(worker if cause.endswith("worker") else client.pid, getattr(signal, cause.split()[0]))
        client.wait(timeout=30)
        assert client.returncode == -getattr(signal, cause.split()[0]), cause
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{worker}").exists(), cause
    assert proc.poll() is None  # the job has a process here still
    job_process.kill()
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(("setting", "ranks_env", "job_env", "on"), [
    ("auto", None, {}, True), ("auto", {"env_vars": {"A": "1"}}, {"env_vars": {"B": "2"}}, True),
    ("auto", {"pip": ["six"]}, {}, False), ("auto", None, {"conda": "env"}, False), (False, None, {}, False),
    (True, None, {}, True)])
def test_the_fork_server_is_on_unless_the_ranks_run_in_a_python_of_their_own(setting, ranks_env, job_env, on):
    assert forkserver.wanted(setting, ranks_env, job_env) is on
    if on:
        assert forkserver.rank_runtime_env(ranks_env or {}) == {**(ranks_env or {}), "py_executable": f"{sys.executable} -m ray_resume.forkserver"}


def test_fork_server_true_where_it_cannot_be_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError) as err:
        forkserver.wanted(True, {"uv": ["six"]}, {})
    assert str(err.value) == ("failure.fork_server is true, but the ranks' runtime env sets `uv`, which runs them in a Python "
                              "of its own that a fork of the server would not be; set failure.fork_server to auto (on wherever "
                              "it can be) or false")
    with pytest.raises(ConfigError, match=r"failure.fork_server is true, but the driver is a Ray Client \(ray://\), and the "
                                          r"nodes may not have its interpreter; set"):
        forkserver.wanted(True, None, {}, ray_client=True)
    assert forkserver.wanted("auto", None, {}, ray_client=True) is False
    monkeypatch.setattr(sys, "platform", "darwin")
    assert forkserver.wanted("auto", None, {}) is False
    with pytest.raises(ConfigError, match=r"failure.fork_server is true, but it needs Linux \(abstract Unix sockets, /proc\), "
                                          r"and this is darwin; set failure.fork_server to auto"):
        forkserver.wanted(True, None, {})
