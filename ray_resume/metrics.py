"""Per-step metrics beside the checkpoint root: `{save_path}-metrics/`.

Object stores cannot append, so each rank buffers its records and writes
them as a new small chunk file (one atomic PUT / rename) every few steps and
after every save. Chunk names start with a millisecond timestamp, so sorted
names are chronological across jobs, attempts and ranks.
"""

from __future__ import annotations

import json
import time

from .checkpoint import paths
from .checkpoint.storage import storage_for


def metrics_dir(save_path: str) -> str:
    return save_path.rstrip("/") + "-metrics"


class MetricsWriter:
    def __init__(self, save_path: str, storage_options, *, job: str, attempt: int, rank: int):
        self.dir = metrics_dir(save_path)
        self.storage = storage_for(self.dir, storage_options)
        self.storage.makedirs(self.dir)
        self.tag = {"job": job, "attempt": attempt, "rank": rank}
        self.pending: list[dict] = []

    def add(self, record: dict) -> None:
        self.pending.append({**self.tag, "time": time.time(), **record})

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{int(self.pending[0]['time'] * 1000):013d}-rank{self.tag['rank']:05d}-{self.tag['job']}-{self.tag['attempt']}.jsonl"
        data = "".join(json.dumps(r) + "\n" for r in self.pending).encode()
        self.storage.write_atomic(paths.join(self.dir, name), data)
        self.pending = []


def read_metrics(save_path: str, storage_options=None) -> list[dict]:
    """Every record of every run that wrote beside `save_path`, oldest first."""
    directory = metrics_dir(save_path)
    storage = storage_for(directory, storage_options)
    records = []
    for name in storage.listdir(directory):
        if name.endswith(".jsonl"):
            records += [json.loads(line) for line in storage.read_bytes(paths.join(directory, name)).splitlines() if line.strip()]
    return records
