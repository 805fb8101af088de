"""Messages between our own processes on one node: length-prefixed JSON over a Unix socket, with
file descriptors passed alongside (SCM_RIGHTS). The writer process speaks it.

A message is a frozen dataclass of its protocol, sent as `{"op": its class name, its fields}` and
made that class again where it is received (`receive` checks its kind and its fields there)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
from collections.abc import Sequence


def send(conn: socket.socket, message, fds: Sequence[int] = ()) -> None:
    body = json.dumps({"op": type(message).__name__, **dataclasses.asdict(message)}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], fds)


def receive(
    conn: socket.socket, expected: tuple[type, ...], timeout: float | None = 5.0, max_fds: int = 3
) -> tuple[object, list[int]]:
    """One message, one of the `expected` classes, and the file descriptors that came with it;
    ConnectionError when the peer is gone or says what the protocol does not."""
    conn.settimeout(timeout)
    head, fds, _, _ = socket.recv_fds(conn, 4, max_fds)
    try:
        if len(head) < 4:
            raise ConnectionError("no message")
        try:
            fields = json.loads(_read(conn, struct.unpack("!I", head)[0]))
        except ValueError as exc:
            raise ConnectionError(f"a message that is not JSON: {exc}") from None
        op = fields.pop("op", None) if isinstance(fields, dict) else None
        kind = next((cls for cls in expected if cls.__name__ == op), None)
        if kind is None:
            raise ConnectionError(f"expected {' or '.join(c.__name__ for c in expected)}, got {op!r}")
        try:
            return kind(**fields), fds
        except TypeError as exc:  # a field missing or not the class's
            raise ConnectionError(f"a malformed {kind.__name__}: {exc}") from None
    except BaseException:
        close(fds)
        raise


def close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data
