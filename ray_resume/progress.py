"""What a rank says while it trains: rank 0's progress lines, the restart's account, and every
rank's records beside the checkpoint root (ray_resume.metrics: JSONL, rank 0's TensorBoard curves)."""

from __future__ import annotations

import logging
import time

from .checkpoint import memory
from .metrics import Curves, MetricsWriter

logger = logging.getLogger(__name__)


class Progress:
    """Progress lines on rank 0, and every rank's per-step metrics beside the checkpoint root."""

    def __init__(self, cfg, rank: int, attempt: int, job_id: str, controller):
        self.cfg, self.rank = cfg, rank
        self.controller = controller
        self.total = cfg.training.train_steps
        self.gbs = cfg.training.global_batch_size
        self.window_start = time.monotonic()
        self.window_steps = 0
        self.metrics = None
        self.curves = None  # rank 0's TensorBoard events
        self.job_id = job_id
        self.every_step = rank == 0 or cfg.training.log_sample_ids  # records every step (see ray_resume.metrics)
        self.last: dict = {}
        # this start's parts until recorded (after a restart: once the lost steps are redone)
        self.start_parts: dict | None = None
        self.committed = controller.last_committed_polled() if rank == 0 else None  # for the progress line
        if cfg.checkpoint.enable_save:
            self.metrics = MetricsWriter(
                cfg.checkpoint.save_path, cfg.checkpoint.storage, job=job_id, attempt=attempt, rank=rank
            )

    def _record(self, record: dict, flush: bool = False) -> None:
        if self.metrics:
            self.metrics.add(record)
            if flush:
                self.metrics.flush()
                if self.curves:
                    self.curves.flush()

    def _say(self, text: str) -> None:
        # Logged, not printed: on a Ray Train worker print() goes to the root logger and, when
        # stdout is wrapped, to stdout as well, and every line reached the console twice.
        if self.rank == 0:
            logger.info("[%s] %s", self.cfg.name, text)

    def resumed(
        self,
        resume,
        world: int,
        attempt: int,
        failed_after: int | None = None,
        lost: dict | None = None,
        clock: dict | None = None,
        restore_s: float = 0.0,
    ) -> None:
        from_memory = memory.is_memory_source(resume.source)
        if self.metrics and self.rank == 0:
            self.curves = Curves(
                self.cfg.checkpoint.save_path,
                self.cfg.checkpoint.storage,
                job=self.job_id,
                attempt=attempt,
                purge_step=resume.step + 1,
            )
            self.curves.add(resume.step, {"attempt": attempt})  # a restart is a step in this curve
        self._record(
            {
                "event": "start",
                "step": resume.step,
                "source": resume.source,
                "world_size": world,
                "consumed_samples": resume.consumed_samples,
                "bytes_read": resume.bytes_read,
            },
            flush=True,
        )
        if attempt > 0 or clock:
            # What this start cost, part by part (summary.START_PARTS, RESTART_PARTS): recorded after the
            # first step, or after a restart once this group has redone the lost steps.
            self.start_parts = {
                "event": "restart" if attempt else "started",
                "step": resume.step,
                "caught_up": (failed_after or resume.step) if attempt else resume.step,
                **(clock or {}),
                "restore_s": restore_s,
                "since": time.monotonic(),
            }
        if attempt > 0:  # a restart: the previous group was lost (Ray Train's account is in its log files)
            reached = f"after step {failed_after}" if failed_after is not None else "before its first step"
            redo = f": {failed_after - resume.step} steps to redo" if failed_after is not None else ""
            why = "".join(f"; rank {r}: {text}" for r, text in (lost or {}).items())
            point = "step 0" if not resume.source else resume.source if from_memory else f"iteration {resume.step}"
            self._say(f"worker group lost {reached} (attempt {attempt - 1}{why}); resuming from {point}{redo}")
        if resume.source is None:
            if not self.cfg.checkpoint.enable_save:
                self._say("checkpoints are off (checkpoint.enable_save: false): nothing will be saved")
            self._say(f"starting from step 0 (attempt {attempt}, world size {world})")
            return
        read = (
            "nothing read from storage"
            if from_memory
            else f"rank 0 read {resume.bytes_read} bytes from storage, load_balanced={self.cfg.checkpoint.load_balanced}"
        )
        self._say(
            f"resumed from {resume.source} (attempt {attempt}, world size {world}): global_step {resume.step}, "
            f"consumed samples {resume.consumed_samples}; continuing at step {resume.step + 1} ({read})"
        )
        if resume.step >= self.total:
            self._say(f"training already reached train_steps={self.total}: nothing left to do")

    def first_batch(self, seconds: float) -> None:
        """How long this start waited for its first batch (the data pipeline's start)."""
        if self.start_parts:
            self.start_parts["first_batch_s"] = seconds

    def _start_parts_at(self, step: int) -> None:
        """The first step after a start, and the step where a restart's lost ones are redone: its record."""
        r = self.start_parts
        elapsed = time.monotonic() - r["since"]
        r.setdefault("first_step_s", elapsed - r.get("first_batch_s", 0.0))
        if step >= r["caught_up"] or step == self.total:
            r["redo_s"] = elapsed - r["first_step_s"] - r.get("first_batch_s", 0.0)
            self._record(
                {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "since"}, flush=True
            )
            self.start_parts = None

    def evaluated(self, step: int, loss: float, samples: int) -> None:
        if self.curves:
            self.curves.add(step, {"eval_loss": loss})
        if self.rank == 0:
            self._record({"event": "eval", "step": step, "eval_loss": loss, "samples": samples}, flush=True)
        self._say(f"eval at step {step}: loss {loss:.4f} over {samples} held-out samples")

    def async_save_chosen(self, step: int, why: str) -> None:
        """`checkpoint.async_save: auto` decided at this step's save (for the summary)."""
        self._record({"event": "async_save_auto", "step": step, "why": why}, flush=True)

    def stopped(self, step: int) -> None:
        self.last["stopped"] = True
        self._record({"event": "stop", "step": step}, flush=True)
        self._say(f"stop requested: saved step {step} and stopping")

    def step(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        sample_ids,
        saved: bool,
        stall: float | None = None,
        flush: bool = False,
        data_bytes: int = 0,
    ) -> None:
        """`data_bytes`: what this rank's data stream has read from storage in this attempt."""
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "saved": saved,
            "data_bytes_read": data_bytes,
        }
        if stall is not None:
            record["save_stall_s"] = round(stall, 6)  # how long this save blocked training
        self.last = dict(record)
        if self.curves:
            self.curves.add(step, {k: v for k, v in record.items() if k in ("loss", "lr", "grad_norm", "save_stall_s")})
        if self.cfg.training.log_sample_ids:
            record["sample_ids"] = sample_ids.tolist()
        log_now = step % self.cfg.training.log_every == 0 or step == self.total
        self.window_steps += 1
        if self.start_parts and self.rank == 0:
            self._start_parts_at(step)
        if self.rank == 0 and log_now:
            self._progress_line(step, loss, lr, grad_norm)
        if self.every_step:
            self._record(record, flush=saved or log_now or flush)
        elif self.metrics:  # another rank: only its save stalls, in a chunk rolled over by time
            if stall is not None:
                self._record(
                    {"step": step, "saved": True, "save_stall_s": record["save_stall_s"], "data_bytes_read": data_bytes}
                )
            if self.metrics.due():
                self.metrics.flush()

    def _progress_line(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        elapsed = max(time.monotonic() - self.window_start, 1e-9)
        rate = self.window_steps / elapsed
        committed = self.committed.latest()
        eta = (self.total - step) / rate if rate else 0.0
        if self.curves:
            self.curves.add(step, {"samples_per_s": rate * self.gbs})
        self._say(
            f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.3g} | grad norm {grad_norm:.3g} | {rate * self.gbs:.0f} samples/s | "
            f"last committed iteration {committed if committed is not None else '-'} | ETA {_clock(eta)}"
        )
        self.window_start, self.window_steps = time.monotonic(), 0


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
