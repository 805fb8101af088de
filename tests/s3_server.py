"""An S3-compatible server (moto) on loopback, for the tests and the benchmarks: one bucket made."""

from __future__ import annotations

import socket

import pyarrow.fs as pafs
from moto.server import ThreadedMotoServer


def start(bucket: str, key: str = "testing") -> tuple[ThreadedMotoServer, dict]:
    """The server, running, with `bucket`; and the `checkpoint.storage` options that reach it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "region": "us-east-1",
        "access_key_id": key,
        "secret_access_key": key,
    }
    # the product's filesystem makes no bucket (allow_bucket_creation is off there, as it should be)
    pafs.S3FileSystem(
        endpoint_override=options["endpoint_url"],
        scheme="http",
        region="us-east-1",
        access_key=key,
        secret_key=key,
        allow_bucket_creation=True,
    ).create_dir(bucket)
    return server, options
