"""Per-step metrics beside the checkpoint root: `{save_path}-metrics/`.

Object stores cannot append, so each rank buffers its records and writes
them as a new small chunk file (one atomic PUT / rename). Rank 0 writes the
curve: every step's record, a chunk every `log_every` steps and after every
save. The other ranks write only what differs between ranks (their starts
with the bytes they read, their save stalls, their last wait) and roll a
chunk over every ROLL_S seconds, so a job makes O(ranks x hours) objects,
not O(ranks x steps): 10,000 ranks for an hour write 60,000, not millions.
With `training.log_sample_ids` (audits, tests) every rank records every step
and flushes like rank 0. Chunk names start with a millisecond timestamp, so
sorted names are chronological across jobs, attempts and ranks.

Rank 0's curves also go to TensorBoard event files under
`{save_path}-metrics/tensorboard/{job}/` (`tensorboard --logdir` on it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from .checkpoint.format import paths
from .checkpoint.root import root_for


ROLL_S = 600.0  # the other ranks' chunk interval


def metrics_dir(save_path: str) -> str:
    return save_path.rstrip("/") + "-metrics"


class MetricsWriter:
    def __init__(self, save_path: str, storage_options, *, job: str, attempt: int, rank: int):
        self.dir = metrics_dir(save_path)
        self.storage = root_for(save_path, storage_options).storage  # the root's own: it serves its siblings too
        self.storage.makedirs(self.dir)
        self.tag = {"job": job, "attempt": attempt, "rank": rank}
        self.pending: list[dict] = []
        self.flushed_at = time.monotonic()
        self.chunks = 0  # in the name: two chunks flushed within one millisecond must not share it

    def due(self) -> bool:
        """A chunk has been open for ROLL_S seconds."""
        return bool(self.pending) and time.monotonic() - self.flushed_at >= ROLL_S

    def add(self, record: dict) -> None:
        self.pending.append({**self.tag, "time": time.time(), **record})

    def flush(self) -> None:
        if not self.pending:
            return
        name = (
            f"{int(self.pending[0]['time'] * 1000):013d}-rank{self.tag['rank']:05d}-{self.tag['job']}-{self.tag['attempt']}"
            f"-{self.chunks:06d}.jsonl"
        )
        self.chunks += 1
        data = "".join(json.dumps(r) + "\n" for r in self.pending).encode()
        self.storage.write_atomic(paths.join(self.dir, name), data)
        self.pending = []
        self.flushed_at = time.monotonic()


def read_metrics(save_path: str, storage_options=None) -> list[dict]:
    """Every record of every run that wrote beside `save_path`, oldest first."""
    directory = metrics_dir(save_path)
    storage = root_for(save_path, storage_options).storage
    records = []
    for name in storage.listdir(directory):
        if name.endswith(".jsonl"):
            records += [
                json.loads(line)
                for line in storage.read_bytes(paths.join(directory, name)).splitlines()
                if line.strip()
            ]
    return records


class Curves:
    """Rank 0's curves as TensorBoard event files, one file per attempt of a job.

    Written synchronously (tensorboardX's EventsWriter, not its SummaryWriter, whose
    queue a flush does not drain: events of a rank killed right after were lost). A
    restarted attempt's file starts with a session start at `purge_step`: TensorBoard
    drops what earlier files hold from that step on, so the redone steps are drawn once.
    On object storage the events go to a local file that is uploaded at each flush and
    then started afresh, so each upload carries only the new events.
    """

    def __init__(self, save_path: str, storage_options, *, job: str, attempt: int, purge_step: int):
        self.dir = paths.join(metrics_dir(save_path), "tensorboard", job)
        self.storage = root_for(save_path, storage_options).storage  # the root's own: it serves its siblings too
        self.remote = paths.on_object_storage(self.dir)
        self.local = tempfile.mkdtemp(prefix="ray_resume-tb-") if self.remote else paths.local_path(self.dir)
        os.makedirs(self.local, exist_ok=True)
        self.attempt, self.part = attempt, 0
        # Imported here, by rank 0 alone: tensorboardX (and the botocore it imports) is 0.1 s of every
        # process's imports, on the path of a restart.
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2, summary_pb2

        self._writer_class, self._event, self._summary = EventsWriter, event_pb2, summary_pb2
        self._open()
        self.writer.write_event(
            event_pb2.Event(
                wall_time=time.time(),
                step=purge_step,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
            )
        )

    def _open(self) -> None:
        self.writer = self._writer_class(os.path.join(self.local, "events"), f".attempt{self.attempt}.{self.part:05d}")

    def add(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary.Summary(
            value=[self._summary.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self.writer.write_event(self._event.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self.writer.flush()
        if self.remote:
            self.writer.close()
            for name in os.listdir(self.local):
                with open(os.path.join(self.local, name), "rb") as f:
                    self.storage.write_atomic(paths.join(self.dir, name), f.read())
                os.remove(os.path.join(self.local, name))
            self.part += 1
            self._open()
