"""A fork server per node and job: a group's processes forked from one that has imported what a
rank imports, once, so that a restart pays none of those imports (3-4 s of a core here).

Ray Train replaces the whole worker group after a failure, and Ray starts each new actor in a new
process (`bash -c "exec <py_executable> default_worker.py ..."`) that imports Ray Train, torch and
`torch._dynamo` again before its first step: the restart floor, more where many processes import at
once. The ranks' runtime env names this module as that `py_executable` (`rank_runtime_env`; the
interpreter stays the driver's, Ray's own default). That process, the *client*, asks its node's
server for a fork:

- where no server has the node's address yet (an abstract Unix socket named by the raylet, the
  job and the runtime env's hash), the client binds it and starts the server, detached (Ray ends a
  worker's child processes with it). So the server is a process Ray started, as a worker is: its
  environment, directory, niceness, cgroup;
- the server imports what a rank does, once, while the first group's clients wait (one import
  for the node's ranks instead of one each), and forks a child per client from then on;
- a client served hands the server its arguments, environment, working directory and standard
  streams, and the child runs Ray's `default_worker.py` in them, as the process Ray would have
  started (ray_resume.forked; scripts/fork_parity.py compares them). The client
  stays as the process Ray started: it passes Ray's signals on to the child and ends as the child
  ends (its exit code, or its signal); the child ends the moment the client does (Ray may SIGKILL
  it). A client the server cannot or does not serve in time runs the worker itself.

Only processes of the server's own user are served, and a client says nothing to a server of
another user (the abstract namespace has no file permissions). The server logs to the Ray
session's log directory and ends once the raylet is gone, or no process of its job has been left
on its node for `IDLE_EXIT_S`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Literal, Sequence, Union

from . import forked, wire

MODULE = "ray_resume.forkserver"  # its name also where it runs as __main__
SETTING_ENV = "RAY_RESUME_FORK_SERVER"  # true/false/auto: what `failure.fork_server: auto` means on this host
IDLE_EXIT_S = 30.0  # no process of the job on the node this long: the job has ended here
ANSWER_S = 10.0  # a server that has not answered a client this long (a fork, or no) is passed by: a cold start
IMPORTS_S = 120.0  # nor one whose imports have not ended this long after the client asked
IMPORTING = f"the server's imports took longer than its clients wait ({IMPORTS_S:.0f} s)"  # its state until they end
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Runtime env fields with which Ray runs the ranks in a Python of their own (a venv, a container):
# a fork of ours would not be it.
OWN_PYTHON = ("py_executable", "pip", "uv", "conda", "image_uri", "container")


def why_off(
    setting: Union[bool, Literal["auto"]], *runtime_envs: dict[str, Any], ray_client: bool = False, gpu: bool = False
) -> str | None:
    """Why the ranks do not start through the fork server (None: they do). `failure.fork_server`,
    where "auto" means `RAY_RESUME_FORK_SERVER` where set, else on, on Linux, for CPU ranks (a
    fork's parity with a fresh process is shown there, tests/test_fork_parity.py; on GPUs not yet),
    unless the ranks' runtime env (Ray Train's `worker_runtime_env`, the job's) runs them in a
    Python of its own or the driver is a Ray Client (`ray://`: its interpreter's path is its own
    machine's). `true` where it cannot be is a mistake, said before any rank starts."""
    if setting == "auto" and os.environ.get(SETTING_ENV, "auto").lower() in ("true", "false"):
        setting = os.environ[SETTING_ENV].lower() == "true"
    own = next((key for env in runtime_envs for key in OWN_PYTHON if (env or {}).get(key)), None)
    why = (
        f"the ranks' runtime env sets `{own}`, which runs them in a Python of its own that a fork of the server "
        "would not be"
        if own
        else "the driver is a Ray Client (ray://), and the nodes may not have its interpreter"
        if ray_client
        else f"it needs Linux (abstract Unix sockets, /proc), and this is {sys.platform}"
        if not sys.platform.startswith("linux")
        else None
    )
    if setting is True and why:
        from .errors import ConfigError

        raise ConfigError(
            f"failure.fork_server is true, but {why}; set failure.fork_server to auto (on wherever it can be) or false"
        )
    if setting is True:
        return None
    if setting is False:
        return "failure.fork_server: false"
    return why or (
        "auto, and the ranks use GPUs, where a fork's parity with a fresh process is not shown yet" if gpu else None
    )


def rank_runtime_env(runtime_env: dict, preload: Sequence[str] = ()) -> dict:
    """The ranks' runtime env with this module as their Python's entry: the driver's interpreter
    (Ray's default), `-m ray_resume.forkserver` before Ray's worker arguments; the server imports
    `preload` too (the caller's modules a rank imports)."""
    entry = f"{sys.executable} -m {MODULE}" + (f" --preload={','.join(preload)}" if preload else "")
    return {**runtime_env, "py_executable": entry}


def _address(argv: list[str], env: dict[str, str]) -> str:
    env_hash = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--runtime-env-hash=")), "")
    parts = (env.get("RAY_RAYLET_PID", ""), env.get("RAY_JOB_ID", ""), env_hash)
    return "ray_resume-forkserver-" + "-".join(parts)  # "\0" + this: in the abstract namespace, no file to remove


# --- the client: the process Ray started ---------------------------------------------------------


def client(argv: list[str]) -> None:
    """Run Ray's worker `argv` (`default_worker.py ...`, after our own `--preload=`) in a fork of
    this node's server, started here where there is none yet; here, as Ray would have, where no
    server of this user answers in time or it says no (and why, it tells the rank: `started_how`)."""
    preload = argv[:1] if argv[:1] and argv[0].startswith("--preload=") else []
    argv = argv[len(preload) :]
    served = _ask_for_fork(argv, preload)
    if served is None:
        os.execv(sys.executable, [sys.executable, *argv])
    conn, child = served
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _signal(child, signum))
    try:
        status = wire.receive(conn, None)[0]["status"]  # the child's wait status, sent when it ends
    except (OSError, ValueError, KeyError):  # the server died: the child ends with this process
        _signal(child, signal.SIGKILL)
        os._exit(1)
    if os.WIFSIGNALED(status):  # end by the same signal, without the handler set above
        if os.WTERMSIG(status) in FORWARDED:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _ask_for_fork(argv: list[str], preload: list[str]) -> tuple[socket.socket, int] | None:
    """The connection to the server and the pid of the child it forked for `argv`, or None: no
    server of this user answered in time, or it cannot fork. Nothing is sent to a socket at the
    address that is another user's (anyone can bind an abstract name first)."""
    address = _address(argv, os.environ)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ANSWER_S)
    try:
        try:
            conn.connect("\0" + address)
        except OSError:  # no server yet
            _start_server(address, preload, argv)
            conn.connect("\0" + address)
        if _peer_uid(conn) != os.getuid():
            raise PermissionError(address)
        wire.send(
            conn,
            {"fork": {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid()}},
            [0, 1, 2],
        )
        answer = wire.receive(conn, ANSWER_S)[0]
        if answer.get("wait"):  # queued while the server imports
            answer = wire.receive(conn, IMPORTS_S)[0]
        if "pid" not in answer:  # {"cold": why}, which the rank learns from the server
            raise ConnectionRefusedError(answer.get("cold"))
        conn.sendall(b"g")  # the child runs only once this client has taken it
        conn.settimeout(None)
        return conn, answer["pid"]
    except (OSError, ValueError):
        conn.close()  # a child forked for it after all reads no "g": it ends without running
        return None


def started_how() -> str:
    """In a rank: "forked" where this process is a fork of the server, else why it is not."""
    if forked.is_fork():
        return "forked"
    answer = _ask(_address(sys.argv, os.environ), {"status": os.getpid()})
    if answer is None:
        return "off (no fork server of this user answered)"
    why = answer.get("cold") or answer.get("why") or f"the fork server did not answer within {ANSWER_S:.0f} s"
    return f"off ({why})"


def serving() -> bool:
    """In a rank: whether this node's server for the ranks of this job and runtime env serves."""
    return _serving(_address(sys.argv, os.environ))


def _serving(address: str) -> bool:
    answer = _ask(address, {"status": os.getpid()})
    return bool(answer and answer.get("serving"))


def _ask(address: str, message: dict) -> dict | None:
    """The server's answer to `message`; None where no server of this user is at `address`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(ANSWER_S)
            conn.connect("\0" + address)
            if _peer_uid(conn) != os.getuid():
                return None
            wire.send(conn, message)
            return wire.receive(conn, ANSWER_S)[0]
    except (OSError, ValueError):  # none here (a rank not started through a client)
        return None


def _start_server(address: str, preload: list[str], argv: list[str]) -> None:
    """Bind the server's address here, so that this client and the next ones connect at once, and
    hand it to a new server, detached (Ray ends a worker's child processes with it), its output in
    the session's log directory as Ray's own processes' is."""
    listener = _listen(address)
    if listener is None:  # another client was first
        return
    worker = dict(arg[2:].split("=", 1) for arg in argv[1:] if arg.startswith("--") and "=" in arg)
    logs = os.path.join(worker.get("temp-dir", ""), worker.get("session-name", ""), "logs")
    options = [*preload, f"--worker-dir={os.path.dirname(os.path.abspath(argv[0]))}"]
    middle = os.fork()  # the server's parent ends at once: the server is no worker's child
    if middle == 0:
        try:
            try:
                log = open(os.path.join(logs, f"{address}.log"), "ab")  # raylet, job, runtime env
            except OSError:  # no session directory (a test's made-up worker)
                log = subprocess.DEVNULL
            subprocess.Popen(
                [sys.executable, "-m", MODULE, "--serve", address, f"--fd={listener.fileno()}", *options],
                pass_fds=[listener.fileno()],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            os._exit(0)
    os.waitpid(middle, 0)
    listener.close()


def _listen(address: str) -> socket.socket | None:
    """A socket listening at `address`, or None where another process has it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + address)
    except OSError:
        listener.close()
        return None
    listener.listen(64)
    return listener


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _peer_uid(conn: socket.socket) -> int:
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


# --- the server --------------------------------------------------------------------------------------


def _log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ray_resume.forkserver[{os.getpid()}]: {text}", flush=True)


def serve(
    address: str,
    idle_exit_s: float = IDLE_EXIT_S,
    listener_fd: int | None = None,
    preload: Sequence[str] = (),
    worker_dir: str | None = None,
) -> dict | None:
    """Import what a rank does (`preload` too), then fork a worker for each client, the ones that
    came during the imports first; end when Ray or the job has left the node. Returns in a child
    only: the request it is to run (`run_worker`)."""
    # Bound by the client that started this server, or here (None: another server has it).
    listener = _listen(address) if listener_fd is None else socket.socket(fileno=listener_fd)
    if listener is None:
        return None
    if worker_dir:  # sys.path as `python default_worker.py` starts with it, before Ray adds its own
        sys.path[0] = worker_dir
    job, raylet = os.environ.get("RAY_JOB_ID", ""), int(os.environ.get("RAY_RAYLET_PID") or 0)
    _log(f"serving job {job or '-'} at @{address}; importing {', '.join(['torch', 'Ray Train', *preload])}")
    imports = threading.Thread(
        target=forked.import_rank_modules, args=(preload,), name="ray_resume-imports", daemon=True
    )
    imports.start()
    began = time.monotonic()
    why_not: str | None = IMPORTING  # None: it forks
    waiting: list[tuple[socket.socket, dict, list[int]]] = []  # clients, each with its standard streams
    clients: dict[int, socket.socket] = {}  # child pid -> the connection of the client it serves
    cold: dict[int, str] = {}  # client pid -> why it was not forked (its rank asks)
    alone_since = None
    while True:
        ready = select.select([listener, *clients.values()], [], [], 1.0 if why_not != IMPORTING else 0.1)[0]
        _end_the_children_of_clients_gone(clients, ready)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                if _peer_uid(conn) == os.getuid():
                    message, fds = wire.receive(conn)
                    if "fork" in message:
                        waiting.append((conn, message["fork"], fds))
                        if why_not == IMPORTING:
                            with contextlib.suppress(OSError):  # a client gone: its fork ends unrun
                                wire.send(conn, {"wait": True})
                        conn = None
                    else:
                        wire.close(fds)
                        pid = message.get("status")
                        wire.send(conn, {"serving": why_not is None, "why": why_not, "cold": cold.get(pid)})
            except Exception:  # noqa: BLE001  (a client that went away, a message not ours: not the server's end)
                pass
            if conn:
                conn.close()
        if why_not == IMPORTING and not imports.is_alive():
            imports.join()
            why_not = forked.cannot_fork() or (
                None
                if forked.forks_draw_distinct_ids()
                else "its forks would draw the same Ray IDs (Ray's ID generator was seeded)"
            )
            gc.freeze()  # what is imported stays out of the forks' collections (pages they would copy)
            _log(
                f"imported in {time.monotonic() - began:.1f} s; "
                + ("forking" if why_not is None else f"not forking: {why_not}")
            )
        while why_not != IMPORTING and waiting:
            conn, request, fds = waiting.pop(0)
            why_not = why_not or forked.cannot_fork()
            if why_not is None:
                others = [listener, *clients.values(), *(c for c, _, _ in waiting)]
                try:
                    child = _fork(conn, request, fds, others, [fd for _, _, more in waiting for fd in more])
                except OSError as exc:  # the system refused the fork: the client runs its worker itself
                    _refuse(conn, request, fds, f"the fork failed ({exc})", cold)
                    continue
                if isinstance(child, dict):  # in the child: leave the server's loop
                    return child
                conn.settimeout(None)  # watched for its end (`_end_the_children_of_clients_gone`)
                clients[child] = conn
                _log(f"forked {child} for client {request['client']}")
            else:
                _refuse(conn, request, fds, why_not, cold)
        _reap(clients)
        if raylet and not os.path.exists(f"/proc/{raylet}"):
            _log("ending: Ray has stopped on this node")
            return None
        if clients or waiting or _job_alive_here(job):
            alone_since = None
        elif alone_since is None:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since > idle_exit_s:
            _log(f"ending: no process of job {job or '-'} left on this node for {idle_exit_s:.0f} s")
            return None


def _refuse(conn: socket.socket, request: dict, fds: list[int], why: str, cold: dict[int, str]) -> None:
    wire.close(fds)
    cold[request["client"]] = why
    _log(f"client {request['client']} starts cold: {why}")
    try:
        wire.send(conn, {"cold": why})
    except OSError:
        pass
    conn.close()


def _fork(
    conn: socket.socket, request: dict, fds: list[int], others: list[socket.socket], other_fds: list[int]
) -> int | dict:
    """A child for `request`, its standard streams `fds` (closed here in any case), holding none of
    the server's sockets (`others`: a client's end must close when the server's does) or other
    clients' streams: its pid here, and in the child the request to run once its client has taken
    it (it ends at once where the client has gone)."""
    try:
        pid = os.fork()
    except OSError:
        wire.close(fds)
        raise
    if pid == 0:
        try:
            for sock in others:
                sock.close()
            wire.close(other_fds)
            conn.settimeout(None)
            if conn.recv(1) != b"g":  # the client gave up on the server (and runs the worker itself)
                os._exit(0)
            conn.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            return request
        except BaseException:
            os._exit(1)
    wire.close(fds)
    try:
        wire.send(conn, {"pid": pid})
    except OSError:  # the client is gone (Ray ended it while it waited): the child reads no "g"
        pass
    return pid


def _end_the_children_of_clients_gone(clients: dict[int, socket.socket], ready: list) -> None:
    """SIGKILL the child of each client whose connection closed (Ray ended the process it started);
    a client whose server is gone ends its child itself (`client`). So the child runs no thread of
    ours, which a fresh worker would not have."""
    for child, conn in list(clients.items()):
        if conn in ready:
            try:
                if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"g":  # not yet taken by the child
                    continue
            except (BlockingIOError, TimeoutError):  # the child took it since
                continue
            except OSError:
                pass
            _log(f"the client of {child} has gone: {child} ended")
            _signal(child, signal.SIGKILL)
            conn.close()
            del clients[child]


def _reap(clients: dict[int, socket.socket]) -> None:
    """Wait for every child that has ended (a client gone has its child's entry removed already)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            try:
                wire.send(conn, {"status": status})
            except OSError:
                pass
            conn.close()


def _job_alive_here(job: str) -> bool:
    """Whether another process of `job` runs here (Ray gives its workers RAY_JOB_ID; fork servers,
    ours or another's, do not count)."""
    mark, me = f"RAY_JOB_ID={job}".encode(), str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != me:
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f"{MODULE}\0--serve".encode() not in f.read():
                        return True
            except OSError:  # gone, or another user's
                continue
    return False


def main(argv: list[str]) -> None:
    """`--serve ADDRESS [--idle=S] [--fd=N] [--preload=A,B] [--worker-dir=D]`: a server, whose
    children return here to run their worker; else a client (`ARGV`: Ray's worker command)."""
    if argv[:1] != ["--serve"]:
        client(argv)
        return
    fresh = {sig: signal.getsignal(sig) for sig in signal.Signals if signal.getsignal(sig) is not None}
    options = dict(arg[2:].split("=", 1) for arg in argv[2:])
    request = serve(
        argv[1],
        float(options.get("idle", IDLE_EXIT_S)),
        int(options["fd"]) if "fd" in options else None,
        [name for name in options.get("preload", "").split(",") if name],
        options.get("worker-dir"),
    )
    if request is not None:
        forked.run_worker(request, fresh)


if __name__ == "__main__":  # one copy of the modules, whose state a rank reads (`forked.is_fork`)
    importlib.import_module(MODULE).main(sys.argv[1:])
