"""A storage fault injector: fail or delay chosen storage calls, below the product's retries.

`install(faults, record)` wraps every backend `storage_for` returns in this
process (`ray_resume.checkpoint.io.storage.wrappers`). A fault names an
operation, the call that fails first (`nth`, counted per process over the
calls of that operation whose path contains `path_contains`), how many
calls in a row fail (`times`), and the error; `delay_s` sleeps before each
matching call instead (or as well). Every injected failure is appended to
`record` as one JSON line, so a test can tell that its faults fired.

Streams fail where a real one does: a write after its first chunk went out
(a partial file), a read at its first `readinto` after the open.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from ray_resume.checkpoint.io import storage as storage_module

OPS = {
    "read": ("read_bytes", "read_range", "open_read"),
    "write": ("write_atomic", "write_durable", "create_new"),
    "list": ("listdir", "sizes"),
    "stat": ("size", "exists", "is_dir"),
    "remove": ("remove", "remove_tree"),
    "rename": ("rename",),
}
_OP_OF = {method: op for op, methods in OPS.items() for method in methods}


@dataclass
class Fault:
    op: str  # a key of OPS
    nth: int = 1  # the first matching call that fails (1-based)
    times: int = 1  # how many matching calls from `nth` on fail
    error: str = "EIO"  # an errno name, "timeout" (TimeoutError) or "reset" (ConnectionResetError)
    path_contains: str = ""
    delay_s: float = 0.0  # slept before every matching call
    once: str = ""  # a file: the fault fires only in the process that creates it, once in all the job's processes

    def exception(self, path: str) -> OSError:
        if self.error == "timeout":
            return TimeoutError(errno.ETIMEDOUT, f"injected timeout on {self.op}", path)
        if self.error == "reset":
            return ConnectionResetError(errno.ECONNRESET, f"injected connection reset on {self.op}", path)
        code = getattr(errno, self.error)
        return OSError(code, f"injected {self.error} on {self.op}", path)


_calls: dict[int, int] = {}  # fault index -> matching calls so far, in this process
_delayed: set[int] = set()  # faults whose delay this process has recorded


def _first_to_claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class FaultyStorage:
    def __init__(self, backend, faults: list[Fault], record: str):
        self.backend, self.faults, self.record = backend, faults, record

    def _hit(self, method: str, path: str) -> Fault | None:
        """The fault this call triggers, if any (after the delays of every matching fault)."""
        hit = None
        for index, fault in enumerate(self.faults):
            if fault.op != _OP_OF.get(method) or fault.path_contains not in path:
                continue
            _calls[index] = _calls.get(index, 0) + 1
            time.sleep(fault.delay_s)
            if fault.delay_s and index not in _delayed:
                _delayed.add(index)
                _append(
                    self.record,
                    {
                        "pid": os.getpid(),
                        "method": method,
                        "path": path,
                        "at": time.time(),
                        "delayed": fault.delay_s,
                        "once": fault.once,
                    },
                )
            if (
                hit is None
                and fault.nth <= _calls[index] < fault.nth + fault.times
                and (not fault.once or _first_to_claim(fault.once))
            ):
                hit = fault
        if hit:
            _append(self.record, {"pid": os.getpid(), "method": method, "path": path, "at": time.time(), **asdict(hit)})
        return hit

    def __getattr__(self, name: str):
        attr = getattr(self.backend, name)
        if name not in _OP_OF:
            return attr

        def call(path, *args, **kwargs):
            fault = self._hit(name, str(path))
            if fault is None:
                return attr(path, *args, **kwargs)
            if name == "write_durable":  # a partial file, then the error
                chunks = iter(args[0])
                return attr(path, _fail_after_first(chunks, fault.exception(str(path))), *args[1:], **kwargs)
            if name == "open_read":
                return _FailingRead(attr(path, *args, **kwargs), fault.exception(str(path)))
            raise fault.exception(str(path))

        return call


def _fail_after_first(chunks, error: OSError):
    yield next(chunks)
    raise error


class FileProxy:
    """A file object passed through, for wrappers that change one of its methods."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class _FailingRead(FileProxy):
    """A file whose first read fails."""

    def __init__(self, f, error: OSError):
        super().__init__(f)
        self.error = error

    def readinto(self, buf):
        self.f.close()
        raise self.error

    read = readinto


def install(faults: list[dict], record: str) -> None:
    """Inject `faults` (Fault fields as dicts) into every storage this process opens from now on; each
    storage built is a line in `record` too (`builds`)."""
    parsed = [Fault(**f) for f in faults]
    _calls.clear()  # counts start with the faults installed
    _delayed.clear()

    def wrap(backend, uri):
        _append(record, {"built": os.getpid(), "uri": uri, "writer": sys.argv[0].endswith("writer_process.py")})
        return FaultyStorage(backend, parsed, record)

    wrap.rebuild = (__name__, "install", [faults, record])  # how a rank's writer process installs the same
    storage_module.wrappers[:] = [wrap]


def _append(record: str, line: dict) -> None:
    with open(record, "a") as f:
        f.write(json.dumps(line) + "\n")


def _lines(record: str) -> list[dict]:
    if not os.path.exists(record):
        return []
    with open(record) as f:
        return [json.loads(line) for line in f]


def injected(record: str) -> list[dict]:
    """The failures injected so far, in every process that wrote to `record`."""
    return [line for line in _lines(record) if "op" in line]


def builds(record: str) -> list[dict]:
    """Every storage built where faults were installed: {"built": the process id, "uri": what for,
    "writer": whether a rank's writer process built it}."""
    return [line for line in _lines(record) if "built" in line]
