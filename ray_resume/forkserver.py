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
  streams, and the child runs Ray's `default_worker.py` in them. The client stays as the process
  Ray started: it passes Ray's signals on to the child and ends as the child ends (its exit code,
  or its signal); the child ends the moment the client does (Ray may SIGKILL it). A client the
  server cannot serve runs the worker itself.

Only processes of the server's own user are served (the abstract namespace has no file
permissions). The server ends once the raylet is gone, or no process of its job has been left on
its node for `IDLE_EXIT_S`.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Literal, Sequence, Union

MODULE = "ray_resume.forkserver"  # its name also where it runs as __main__
IDLE_EXIT_S = 30.0  # no process of the job on the node this long: the job has ended here
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Runtime env fields with which Ray runs the ranks in a Python of their own (a venv, a container):
# a fork of ours would not be it.
OWN_PYTHON = ("py_executable", "pip", "uv", "conda", "image_uri", "container")


def wanted(setting: Union[bool, Literal["auto"]], *runtime_envs: dict[str, Any], ray_client: bool = False) -> bool:
    """Whether the ranks start through the fork server: `failure.fork_server`, where "auto" means
    on Linux, unless the ranks' runtime env (Ray Train's `worker_runtime_env`, the job's) runs them
    in a Python of its own or the driver is a Ray Client (`ray://`: its interpreter's path is its
    own machine's); `true` where it cannot be is a mistake, said before any rank starts."""
    own = next((key for env in runtime_envs for key in OWN_PYTHON if (env or {}).get(key)), None)
    why = (f"the ranks' runtime env sets `{own}`, which runs them in a Python of its own that a fork of the server "
           "would not be" if own else
           "the driver is a Ray Client (ray://), and the nodes may not have its interpreter" if ray_client else
           f"it needs Linux (abstract Unix sockets, /proc), and this is {sys.platform}"
           if not sys.platform.startswith("linux") else None)
    if setting is True and why:
        from .errors import ConfigError

        raise ConfigError(f"failure.fork_server is true, but {why}; set failure.fork_server to auto (on wherever it "
                          "can be) or false")
    return setting is True or (setting == "auto" and why is None)


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
    this node's server, started here where there is none yet, or here where it cannot serve."""
    preload = argv[:1] if argv[:1] and argv[0].startswith("--preload=") else []
    argv = argv[len(preload):]
    address = _address(argv, os.environ)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            conn.connect("\0" + address)
        except OSError:  # no server yet
            _start_server(address, preload)
            conn.connect("\0" + address)
        _send(conn, {"fork": {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid()}}, [0, 1, 2])
        child = struct.unpack("!i", _read(conn, 4))[0]  # once the server has imported
    except OSError:  # a server that cannot serve
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _signal(child, signum))
    try:
        status = struct.unpack("!i", _read(conn, 4))[0]  # the child's wait status, sent when it ends
    except OSError:  # the server died: the child follows this process
        os._exit(1)
    if os.WIFSIGNALED(status):  # end by the same signal, without the handler set above
        if os.WTERMSIG(status) in FORWARDED:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def serving() -> bool:
    """In a rank: whether this node's server for the ranks of this job and runtime env serves."""
    return _serving(_address(sys.argv, os.environ))


def _serving(address: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect("\0" + address)
            _send(conn, {"serving": True})
            return _read(conn, 1) == b"1"
    except OSError:  # none here (a rank not started through a client)
        return False


def _start_server(address: str, options: list[str]) -> None:
    """Bind the server's address here, so that this client and the next ones connect at once, and
    hand it to a new server, detached (Ray ends a worker's child processes with it)."""
    listener = _listen(address)
    if listener is None:  # another client was first
        return
    middle = os.fork()  # the server's parent ends at once: the server is no worker's child
    if middle == 0:
        try:
            subprocess.Popen([sys.executable, "-m", MODULE, "--serve", address, f"--fd={listener.fileno()}", *options],
                             pass_fds=[listener.fileno()], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    body = json.dumps(message).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], fds)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


# --- the server --------------------------------------------------------------------------------------

def serve(address: str, idle_exit_s: float = IDLE_EXIT_S, listener_fd: int | None = None, preload: Sequence[str] = ()) -> None:
    """Import what a rank does (`preload` too), then fork a worker for each client, the ones that
    came during the imports first; end when Ray or the job has left the node."""
    # Bound by the client that started this server, or here (None: another server has it).
    listener = _listen(address) if listener_fd is None else socket.socket(fileno=listener_fd)
    if listener is None:
        return
    job, raylet = os.environ.get("RAY_JOB_ID", ""), int(os.environ.get("RAY_RAYLET_PID") or 0)
    imports = threading.Thread(target=_import_rank_modules, args=(preload,), name="ray_resume-imports", daemon=True)
    imports.start()
    can_serve: bool | None = None  # known once the imports are done
    waiting: list[tuple[socket.socket, dict, list[int]]] = []  # clients, each with its standard streams
    clients: dict[int, socket.socket] = {}  # child pid -> the connection of the client it serves
    alone_since = None
    while True:
        if select.select([listener], [], [], 1.0 if can_serve is not None else 0.1)[0]:
            conn, _ = listener.accept()
            try:
                if _peer_uid(conn) == os.getuid():
                    message, fds = _receive(conn)
                    if "fork" in message:
                        waiting.append((conn, message["fork"], fds))
                        conn = None
                    else:
                        _close(fds)
                        conn.sendall(b"1" if can_serve else b"0")
            except Exception:  # noqa: BLE001  (a client that went away, a message not ours: not the server's end)
                pass
            if conn:
                conn.close()
        if can_serve is None and not imports.is_alive():
            imports.join()
            # Never fork with a Python thread running (it may hold a lock the child would wait on
            # forever) or a CUDA context (a child cannot use it), nor where forks would share IDs.
            can_serve = threading.active_count() == 1 and not _cuda_initialized() and _forks_draw_distinct_ids()
            gc.freeze()  # what is imported stays out of the forks' collections (pages they would copy)
        while can_serve is not None and waiting:
            conn, request, fds = waiting.pop(0)
            if not can_serve:  # the client runs its worker itself
                _close(fds)
                conn.close()
                continue
            others = [listener, *clients.values(), *(c for c, _, _ in waiting)]
            try:
                clients[_fork(conn, request, fds, others, [fd for _, _, more in waiting for fd in more])] = conn
            except OSError:  # the system refused the fork: the client runs its worker itself
                conn.close()
        _reap(clients)
        if raylet and not os.path.exists(f"/proc/{raylet}"):  # Ray has stopped on this node
            return
        if clients or waiting or _job_alive_here(job):
            alone_since = None
        elif alone_since is None:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since > idle_exit_s:
            return


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(5.0)
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    try:
        if len(head) < 4:
            raise ConnectionError("no message")
        return json.loads(_read(conn, struct.unpack("!I", head)[0])), fds
    except BaseException:
        _close(fds)
        raise


def _fork(conn: socket.socket, request: dict, fds: list[int], others: list[socket.socket], other_fds: list[int]) -> int:
    """A child running `request`'s worker with `fds` as its standard streams (closed here in any
    case), and none of the server's sockets (`others`: a client's end must close when the server's
    does) or other clients' streams."""
    try:
        pid = os.fork()
    except OSError:
        _close(fds)
        raise
    if pid == 0:
        try:
            for sock in (conn, *others):
                sock.close()
            _close(other_fds)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            _run_worker(request)
        finally:
            os._exit(1)
    _close(fds)
    try:
        conn.sendall(struct.pack("!i", pid))
    except OSError:  # the client is gone (Ray ended it while it waited): the child follows it
        pass
    return pid


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _run_worker(request: dict) -> None:
    """In the child: become the process Ray started (its environment, directory and arguments) and
    run Ray's worker as `python default_worker.py ...` would."""
    os.setsid()
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _follow(request["client"])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _follow(client: int) -> None:
    """SIGKILL this child the moment its client ends."""
    def watch() -> None:
        try:
            select.select([os.pidfd_open(client)], [], [])
        except (AttributeError, OSError):  # no pidfd here: poll
            while os.path.exists(f"/proc/{client}"):
                time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ray_resume-client", daemon=True).start()


def _reap(clients: dict[int, socket.socket]) -> None:
    while clients:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(struct.pack("!i", status))
            except OSError:
                pass
            conn.close()


def _peer_uid(conn: socket.socket) -> int:
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


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


def _import_rank_modules(preload: Sequence[str]) -> None:
    """What a rank imports before its first step: torch, `torch._dynamo` (DDP's constructor imports
    it), Ray, Ray Train (its worker actor's module, `ray.train.torch`) and `preload`. Module-level
    `@ray.remote` classes in Ray Train and Ray Data draw an `ActorClassID` at import, and the first
    draw seeds Ray's ID generator, whose state forks share: every fork after it drew the same IDs
    (two ranks died in Ray's object store warm-up, "Seal() called on an object without a reference
    to it"). Those class IDs come from the OS here instead (they are a class's label, never looked
    up); `_forks_draw_distinct_ids` checks that no other draw was made."""
    import torch._dynamo  # noqa: F401
    import ray.actor
    from ray._raylet import ActorClassID

    class FromTheOS:
        @staticmethod
        def from_random() -> ActorClassID:
            return ActorClassID(os.urandom(ActorClassID.size()))

    ray.actor.ActorClassID = FromTheOS
    try:
        import ray.train.torch  # noqa: F401
        import ray.train.v2._internal.execution.worker_group.worker  # noqa: F401  (Ray Train's worker actor)
        import ray.tune  # noqa: F401  (Ray Train's worker imports it when it sets up torch)

        for name in preload:
            importlib.import_module(name)
    finally:
        ray.actor.ActorClassID = ActorClassID


def _forks_draw_distinct_ids() -> bool:
    """Whether two forks of this process draw different random Ray IDs."""
    from ray._raylet import ObjectID

    drawn = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, ObjectID.from_random().binary())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        drawn.append(os.read(read, 64))
        os.close(read)
    return drawn[0] != drawn[1]


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_initialized()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:  # --serve ADDRESS [--idle=S] [--fd=N] [--preload=A,B]
        options = dict(arg[2:].split("=", 1) for arg in sys.argv[3:])
        serve(sys.argv[2], float(options.get("idle", IDLE_EXIT_S)), int(options["fd"]) if "fd" in options else None,
              [name for name in options.get("preload", "").split(",") if name])
    else:
        client(sys.argv[1:])
