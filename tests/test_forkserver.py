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
from ray_resume import forkserver, wire
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
    """The first group's processes and the restarted group's new ones are forks of one server on
    the node (`failure.fork_server: true`, what `auto` is on CPU ranks unless RAY_RESUME_FORK_SERVER
    says otherwise, as when the suite runs with it off)."""
    import ray
    import ray.train

    result = ray_resume.fit(
        train_func,
        train_loop_config={"dir": str(tmp_path)},
        checkpoint={"save_path": str(tmp_path / "root"), "save_interleaved_steps": 1},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        failure_config={"max_failures": 1, "fork_server": True},
    )
    assert result.committed_iteration == STEPS
    assert json.loads((tmp_path / "killed.json").read_text())["serving"] is True
    first, restarted = (
        [json.loads((tmp_path / f"{attempt}-{rank}.json").read_text()) for rank in range(2)]
        for attempt in ("first", "restarted")
    )
    assert len({r["parent"] for r in first + restarted}) == 1, (first, restarted)  # one server for the node
    assert f"-m {forkserver.MODULE} --serve" in command_line(restarted[0]["parent"])
    assert not {r["pid"] for r in restarted} & {r["pid"] for r in first}, (first, restarted)  # new processes
    # The server says what it did in the session's log directory, beside Ray's own processes' logs.
    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    [said] = [
        text
        for log in session.glob("logs/ray_resume-forkserver-*.log")
        if f"forked {restarted[0]['pid']} for client " in (text := log.read_text())
    ]
    assert "; forking" in said and all(f"forked {r['pid']} for client " in said for r in first + restarted), said


WORKER = textwrap.dedent("""
    import atexit, json, os, sys, time
    print("hello from the worker", flush=True)
    imported = {name: name in sys.modules for name in ("torch", "ray.train.torch", "ray_resume.rank")}
    import ray.train
    from ray._raylet import ObjectID
    from ray_resume import forkserver
    nth = os.environ.get("NTH", "")
    json.dump({"pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv,
               "mine": os.environ.get("MY_VAR"), "imported": imported, "how": forkserver.started_how(),
               "ray_id": ObjectID.from_random().hex()}, open(f"report{nth}.json", "w"))
    atexit.register(lambda: open(f"atexit{nth}", "w").close())
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


def run_client(env: dict, argv: list[str], cwd: Path, *extra: str, answer_s: float | None = None) -> subprocess.Popen:
    """A client as Ray's worker command starts one; `answer_s`: how long it waits for a server's answer."""
    how = ["-m", forkserver.MODULE]
    if answer_s is not None:
        how = ["-c", f"import sys, {forkserver.MODULE} as f; f.ANSWER_S = {answer_s}; f.main(sys.argv[1:])"]
    return subprocess.Popen(
        [sys.executable, *how, PRELOAD, *argv, *extra],
        env={**env, "MY_VAR": "x"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
    )


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
    server = next(
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and address in command_line(int(p.name))
    )
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
    server = subprocess.Popen(
        [sys.executable, "-m", forkserver.MODULE, "--serve", address, "--idle=1", PRELOAD], env=env
    )
    ended = subprocess.Popen(["true"])  # a client that has ended
    ended.wait()
    (tmp_path / "gone").mkdir()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            until(lambda: gone.connect_ex("\0" + address) == 0, "the server listens")
            wire.send(
                gone,
                {"fork": {"argv": argv, "env": env, "cwd": str(tmp_path / "gone"), "client": ended.pid}},
                [0, 1, 2],
            )
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
    got = report(tmp_path)
    assert (client.returncode, out, got["pid"]) == (7, "hello from the worker\n", client.pid)
    assert got["how"] == "off (no fork server of this user answered)"


@pytest.mark.invariant(16)
def test_a_client_passes_a_server_of_another_user_by_and_sends_it_nothing(tmp_path):
    """Anyone on the node can bind the address first (an abstract name has no permissions): a
    server of another uid gets no environment, no credentials, no streams; the worker starts cold."""
    env, argv, address = job_env(tmp_path)
    fake = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, socket, sys
        os.setgid(65534); os.setuid(65534)  # nobody
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0{address}"); s.listen(1)
        print("listening", flush=True)
        conn, _ = s.accept()
        conn.settimeout(20)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            pass
        sys.stdout.write(repr(data))
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout.readline() == "listening\n"
    client = run_client(env, argv, tmp_path)
    out, _ = client.communicate(timeout=60)
    assert (client.returncode, out, report(tmp_path)["pid"]) == (7, "hello from the worker\n", client.pid)
    assert fake.communicate(timeout=30)[0] == "b''"  # the connection closed with nothing sent


def test_a_server_that_does_not_answer_is_passed_by(tmp_path):
    """One of this user's that hangs (stopped, stuck in its imports' start): a cold start after ANSWER_S."""
    env, argv, address = job_env(tmp_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind("\0" + address)
        mute.listen(1)
        began = time.monotonic()
        answer_s = 2.0  # not ANSWER_S's 10: the wait, not its length, is the point
        client = run_client(env, argv, tmp_path, answer_s=answer_s)
        client.wait(timeout=60)
        waited = time.monotonic() - began
    out, _ = client.communicate(timeout=10)  # (the streams the client sent stayed in the mute socket's queue)
    assert (client.returncode, out, report(tmp_path)["pid"]) == (7, "hello from the worker\n", client.pid)
    assert waited >= answer_s


def test_the_server_forks_only_with_no_thread_but_its_own():
    """`/proc/self/task` counts native threads too: OpenBLAS's pool, started as numpy loads (unless
    told otherwise, as the server's imports are), or the CUDA driver's after a device query
    (scripts/gpu_check.py shows that one, and CUDA initialised, on a GPU)."""
    check = "from ray_resume import forked; print(forked.cannot_fork())"
    cases = {
        "": "None",
        "import numpy": "native threads in the server (1 besides its own)",
        "import os; os.environ.update(forked.NO_THREADS_AT_LOAD); import torch, pyarrow": "None",
    }
    for setup, expected in cases.items():
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
        out = subprocess.run(
            [sys.executable, "-c", f"from ray_resume import forked\n{setup}\n{check}"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == expected, setup


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
    assert got["how"] == "forked"
    assert (tmp_path / "atexit").exists()  # its end is an interpreter's: `atexit` handlers ran


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


@pytest.mark.parametrize(
    ("setting", "ranks_env", "job_env", "gpu", "off"),
    [
        ("auto", None, {}, False, None),
        ("auto", {"env_vars": {"A": "1"}}, {"env_vars": {"B": "2"}}, False, None),
        (
            "auto",
            {"pip": ["six"]},
            {},
            False,
            "the ranks' runtime env sets `pip`, which runs them in a Python of its own that "
            "a fork of the server would not be",
        ),
        (
            "auto",
            None,
            {"conda": "env"},
            False,
            "the ranks' runtime env sets `conda`, which runs them in a Python of its own "
            "that a fork of the server would not be",
        ),
        (
            "auto",
            None,
            {},
            True,
            "auto, and the ranks use GPUs, where a fork's parity with a fresh process is not shown yet",
        ),
        (False, None, {}, False, "failure.fork_server: false"),
        (True, None, {}, False, None),
        (True, None, {}, True, None),
    ],
)
def test_the_fork_server_is_on_for_cpu_ranks_unless_they_run_in_a_python_of_their_own(
    setting, ranks_env, job_env, gpu, off, monkeypatch
):
    monkeypatch.delenv(forkserver.SETTING_ENV, raising=False)
    assert forkserver.why_off(setting, ranks_env, job_env, gpu=gpu) == off
    if off is None:
        assert forkserver.rank_runtime_env(ranks_env or {}) == {
            **(ranks_env or {}),
            "py_executable": f"{sys.executable} -m ray_resume.forkserver",
        }


@pytest.mark.parametrize(
    ("host", "setting", "off"),
    [
        ("false", "auto", "failure.fork_server: false"),
        ("false", True, None),
        ("true", "auto", None),
        ("auto", "auto", None),
        ("true", False, "failure.fork_server: false"),
    ],
)
def test_the_hosts_setting_is_what_auto_means(host, setting, off, monkeypatch):
    """RAY_RESUME_FORK_SERVER (a cluster's admins, the suite run both ways) decides where the job's
    config says auto; a job's own true or false stands."""
    monkeypatch.setenv(forkserver.SETTING_ENV, host)
    assert forkserver.why_off(setting) == off


def test_fork_server_true_where_it_cannot_be_is_a_config_error(monkeypatch):
    monkeypatch.delenv(forkserver.SETTING_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        forkserver.why_off(True, {"uv": ["six"]}, {})
    assert str(err.value) == (
        "failure.fork_server is true, but the ranks' runtime env sets `uv`, which runs them in a Python "
        "of its own that a fork of the server would not be; set failure.fork_server to auto (on wherever "
        "it can be) or false"
    )
    with pytest.raises(
        ConfigError,
        match=r"failure.fork_server is true, but the driver is a Ray Client \(ray://\), and the "
        r"nodes may not have its interpreter; set",
    ):
        forkserver.why_off(True, None, {}, ray_client=True)
    assert (
        forkserver.why_off("auto", None, {}, ray_client=True)
        == "the driver is a Ray Client (ray://), and the nodes may not have its interpreter"
    )
    monkeypatch.setattr(sys, "platform", "darwin")
    assert forkserver.why_off("auto", None, {}) == "it needs Linux (abstract Unix sockets, /proc), and this is darwin"
    with pytest.raises(
        ConfigError,
        match=r"failure.fork_server is true, but it needs Linux \(abstract Unix sockets, /proc\), "
        r"and this is darwin; set failure.fork_server to auto",
    ):
        forkserver.why_off(True, None, {})
