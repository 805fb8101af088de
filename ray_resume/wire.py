"""Messages between our own processes on one node: length-prefixed JSON over a Unix socket, with
file descriptors passed alongside (SCM_RIGHTS). The writer process speaks it."""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Sequence


def send(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], fds)


def receive(conn: socket.socket, timeout: float | None = 5.0, max_fds: int = 3) -> tuple[dict, list[int]]:
    """One message and the file descriptors that came with it; ConnectionError when the peer is gone."""
    conn.settimeout(timeout)
    head, fds, _, _ = socket.recv_fds(conn, 4, max_fds)
    try:
        if len(head) < 4:
            raise ConnectionError("no message")
        return json.loads(_read(conn, struct.unpack("!I", head)[0])), fds
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
