"""A soak under random faults: the job runs again and again while faults nobody chose hit it.

    python -m benchmarks.soak --minutes 30 --seed 1 --out benchmarks/soak_results.json --plot benchmarks/soak.png
    python -m benchmarks.soak --cover --seed 1        # the short soak CI runs: every kind once, then stop

Each round is one job (the built-in GPT, 2 ranks, 24 steps, a save every 4, save_max 2) taken from an
empty root to its last step through as many submissions as it takes, every other round on an S3
server on loopback (moto): a seeded draw gives each submission up to four faults of the kinds in KINDS, at moments and steps nobody chose, overlapping
(a storage fault under a rank kill under a power cut), and the job is resubmitted, as `ray job
submit`'s retries would, whenever one ends it. The job runs on the in-process harness
(tests/harness.py: the product's own driver, controller, ranks, writer and commit on gloo, without
Ray), so a fault costs seconds and hundreds fit in half an hour.

Checked against a model, not by eye: an uninterrupted reference run of the same job that commits
every step. After every fault that stops the job, the processes are gone, the tracker names an
iteration that verifies and is the reference's byte for byte, and no commit seen before the fault
is lost; at the end of each round every step's loss and samples are the reference's, every retained
iteration is too, save_max holds, and no lease, temporary file or stray iteration is left. The first
check that fails stops the soak (exit 1) with the seed, so that it replays (the schedule's draws
do; where a kill lands depends on timing too).

A node removed and added needs a Ray cluster (tests/test_elastic_cluster.py, test_memory_tier.py)
and a `fit()` loop needs Ray Train's context: neither is among the kinds.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing.forkserver
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the in-process harness and its storage fault injector

import harness  # noqa: E402
import s3_server  # noqa: E402
from conftest import tiny_config  # noqa: E402
import storage_faults  # noqa: E402

from benchmarks import soak_faults  # noqa: E402
from ray_resume import api  # noqa: E402
from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.io.lease import LEASE_DIR
from ray_resume.checkpoint.io.iterations import iteration_steps, read_tracker
from ray_resume.checkpoint.root import CheckpointRoot, root_for  # noqa: E402
from ray_resume.cli.common import verify_iteration  # noqa: E402
from ray_resume.driver import TrainingFailed  # noqa: E402
from ray_resume.errors import USER_ERRORS, CheckpointError  # noqa: E402
from ray_resume.metrics import metrics_dir, read_metrics  # noqa: E402

KINDS = {
    "rank_killed": "a rank SIGKILLed from outside at a random moment (mid-step, mid-write, mid-report)",
    "rank_killed_after_step": "a rank killed right after its optimizer step",
    "rank_killed_mid_write": "a rank killed halfway through writing a shard (async save)",
    "rank_killed_before_report": "a rank killed with its shards written, before it reports them for the commit",
    "driver_killed": "the driver SIGKILLed at a random moment; resubmitted",
    "driver_killed_mid_commit": "the driver killed between an iteration's JSON and its tracker; resubmitted",
    "driver_killed_mid_retention": "the driver killed while it deletes an old iteration; resubmitted",
    "commit_failed": "a commit's tracker write fails: the job saves, ends with it; resubmitted",
    "sigterm": "SIGTERM to the driver: save, stop, resubmitted",
    "preemption_notice": "Ray Train's preemption notice: save at once and go on",
    "power_cut": "every process of the job frozen, what was never fsynced lost, all killed; resubmitted",
    "storage_error": "a transient storage error (EIO, timeout, connection reset) on a write, read, list or stat",
    "torn_write": "a shard write fails after its first chunk went out (a partial file)",
    "storage_delay": "every call of one storage operation slowed by up to 0.2 s",
    "disk_full": "ENOSPC on a checkpoint write: that save fails",
    "second_job": "a second job started on the same root: refused, changing nothing",
}
PHASES = {
    "rank_killed_after_step": "after_optimizer_step",
    "rank_killed_mid_write": "mid_shard_write",
    "rank_killed_before_report": "before_report",
    "driver_killed_mid_commit": "commit_before_tracker",
    "driver_killed_mid_retention": "retention_delete",
    "commit_failed": "commit_fails",
}
TIMED = ("rank_killed", "driver_killed", "sigterm", "power_cut", "second_job")
ENDS_SUBMISSION = ("driver_killed", "sigterm", "power_cut")
STORAGE = ("storage_error", "torn_write", "storage_delay", "disk_full")
INVARIANTS = {
    "processes": "no process of a stopped job is left",
    "tracker": "the tracker names an iteration that verifies (`ray-resume verify`)",
    "no_commit_lost": "no iteration committed before a fault is lost by it",
    "bytes": "a committed iteration is the reference's, shard for shard, byte for byte",
    "losses": "every step run, before or after any fault, has the reference's loss and samples",
    "final_samples": "the last run of every step consumed exactly the reference's samples",
    "save_max": "save_max holds: the root keeps at most save_max iterations of each job (the spec's rule; one more of a job "
    "whose driver died, as the deletion due at its last commit may not have run), the last step's among them",
    "leftovers": "no temporary file, uncommitted iteration or held lease is left at the end",
    "second_job": "a second job on the same root is refused, naming the job that holds it",
}

STEPS, SAVE_EVERY, SAVE_MAX, GLOBAL_BATCH = 24, 4, 2, 16
MAX_SUBMISSIONS = 40  # of one round
PROGRESS_EVERY_S = 30
STEP_SLEEP = 0.03  # per micro-batch (2 a step): faults drawn at random land inside training

logger = logging.getLogger("soak")


class SoakFailure(Exception):
    """A check failed: what, where."""


def job_config(
    root: CheckpointRoot, data: str, options: dict | None, save_every: int = SAVE_EVERY, save_max: int = SAVE_MAX
) -> dict:
    """The tests' tiny job (a fault every few seconds on 2 cores; it crosses an epoch boundary at step 10),
    every step logged, restarted as often as faults come."""
    storage = {"storage": options} if options else {}
    training = {"global_batch_size": GLOBAL_BATCH, "train_steps": STEPS, "log_every": 1}
    checkpoint = {"save_path": root.uri, "save_interleaved_steps": save_every, "save_max": save_max, **storage}
    return tiny_config(
        Path(data), "soak", data={"path": data}, training=training, failure={"max_failures": 100}, checkpoint=checkpoint
    )


def committed_state(root: CheckpointRoot, step: int) -> dict:
    """What a load of iteration `step` sees: its shards' bytes and its progress fields."""
    directory = root.iteration_dir(step)
    common = {k: root.iteration(step).common[k] for k in ("global_step", "consumed_samples", "epoch_num", "step_num")}
    return {
        "shards": {
            name: root.storage.read_bytes(paths.join(directory, name))
            for name in sorted(root.storage.listdir(directory))
            if paths.parse_shard_filename(name)
        },
        "common": common,
    }


def step_runs(records: list[dict]) -> dict[int, list[dict]]:
    """For each step, each run of it in order: {"loss", "ids" (all ranks'), "time" (rank 0's)}."""
    runs: dict[int, dict[tuple, dict]] = {}
    for r in sorted(records, key=lambda r: r["time"]):
        if "loss" in r:
            run = runs.setdefault(r["step"], {}).setdefault(
                (r["job"], r["attempt"]), {"loss": r["loss"], "ids": [], "time": r["time"]}
            )
            run["ids"] = sorted(run["ids"] + r["sample_ids"])
            if r["rank"] == 0:
                run["loss"], run["time"] = r["loss"], r["time"]
    return {step: list(by_run.values()) for step, by_run in sorted(runs.items())}


def job_processes() -> list[int]:
    """The live processes of the harness's jobs: the forkserver's children (the ranks, the controller)."""
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    if server is None:
        return []
    try:
        return [p.pid for p in psutil.Process(server).children() if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


@dataclass
class Fault:
    kind: str
    round: int
    at: float  # wall time it was injected
    detail: str = ""
    lost_s: float | None = None  # see Soak.attribute_lost_time


@dataclass
class Plan:
    """One submission's faults."""

    phase: dict | None = None  # the fault injected into the job (faults.Fault's fields)
    phase_kind: str | None = None
    storage: list[tuple[str, dict]] = field(default_factory=list)  # (kind, tests/storage_faults.Fault fields)
    timed: list[tuple[str, float]] = field(default_factory=list)  # (kind, moment: a fraction of the remaining training)
    notice_at: float | None = None  # a fraction of the remaining training


class Soak:
    def __init__(self, work: Path, seed: int, kinds: list[str], mutations: tuple[str, ...] = ()):
        self.work, self.rng, self.kinds, self.mutations = work, random.Random(seed), kinds, mutations
        self.seed = seed
        self.victims = random.Random(-seed)  # drawn as faults land: timing must not shift the schedule's draws
        self.faults: list[Fault] = []
        self.checked: Counter = Counter()
        self.journal = str(work / "fsync-journal")
        self.job_log = str(work / "jobs.log")  # what the job's processes print
        self.rounds = self.submissions = 0
        self.timeline: list[tuple[int, float, int]] = []  # (round, time, step) of rank 0's steps
        self.timed_error: BaseException | None = None  # what the thread injecting timed faults raised
        self.sigterm_sent = False  # a SIGTERM of the soak's own, for the job, is on its way
        self.sigterm_dropped = False  # ... and it came when no job ran
        self.committed_seen: int | None = None  # the tracker as a fault that ends the job hit
        self.s3: dict | None = None  # the S3 server's checkpoint.storage options, if every other round is on it
        self.options: dict | None = None  # this round's checkpoint.storage
        self.s3_rounds = 0
        # jobs whose driver died: the deletion due at their last commit may not have run
        self.killed_jobs: set[str] = set()

    def on_sigterm(self, signum, frame) -> None:
        """Outside a job's run (whose driver takes SIGTERM as a stop request): the soak's own SIGTERM, come
        as the job ended, is dropped; anyone else's stops the soak."""
        if not self.sigterm_sent:
            raise KeyboardInterrupt("SIGTERM")
        self.sigterm_sent = False
        self.sigterm_dropped = True

    # ------------------------------------------------------------------------- the reference

    def make_reference(self) -> None:
        """The job uninterrupted, committing every step (kept): every iteration a soak round may commit."""
        root = root_for(str(self.work / "reference" / "ckpt"))
        cfg = job_config(root, str(self.work / "data"), None, save_every=1, save_max=STEPS)
        outcome = harness.run_job(cfg, setup=(soak_faults.prepare, self.journal, self.job_log))
        assert outcome.error is None and outcome.committed == STEPS, outcome
        self.reference = {step: committed_state(root, step) for step in range(1, STEPS + 1)}
        self.reference_steps = {step: runs[0] for step, runs in step_runs(read_metrics(root.uri)).items()}
        times = [self.reference_steps[s]["time"] for s in range(1, STEPS + 1)]
        self.step_s = statistics.median(b - a for a, b in zip(times, times[1:])) + 2 * STEP_SLEEP

    # ------------------------------------------------------------------------- drawing faults

    def draw(self, committed: int, pending: list[str]) -> Plan:
        """One to four faults for a submission that resumes from `committed`: the kinds still pending
        first (--cover), then any; at most one phase fault and one fault that ends the submission."""
        plan = Plan()
        count = self.rng.randint(1, 4)
        wanted = pending[:count] + [self.rng.choice(self.kinds) for _ in range(count - len(pending[:count]))]
        for kind in wanted:
            if kind in PHASES and plan.phase is None:
                steps = self.phase_steps(kind, committed)
                if steps:
                    plan.phase = {"phase": PHASES[kind], "step": self.rng.choice(steps), "rank": self.rng.randint(0, 1)}
                    plan.phase_kind = kind
            elif kind in STORAGE and len(plan.storage) < 2:
                plan.storage.append((kind, self.storage_fault(kind)))
            elif kind == "preemption_notice":
                plan.notice_at = self.moment()
            elif kind in TIMED and not (kind in ENDS_SUBMISSION and any(k in ENDS_SUBMISSION for k, _ in plan.timed)):
                plan.timed.append((kind, self.moment()))
        return plan

    def moment(self) -> float:
        """When a fault lands, as a fraction of the submission's remaining training. A fifth of the draws
        fall after its end: else a power cut would land before each next save once few steps remain."""
        return self.rng.uniform(0.0, 1.25)

    def phase_steps(self, kind: str, committed: int) -> list[int]:
        ahead = range(committed + 1, STEPS + 1)
        if kind == "rank_killed_after_step":
            return list(ahead)
        saves = [s for s in ahead if s % SAVE_EVERY == 0]
        # the fault is at the deletion of its step: all but a job's last save_max
        if kind == "driver_killed_mid_retention":
            return saves[:-SAVE_MAX]
        return saves

    def storage_fault(self, kind: str) -> dict:
        # fires once in all the job's processes; names it
        once = str(self.work / f"claim-{self.rng.getrandbits(64):016x}")
        if kind == "storage_error":
            op = self.rng.choice(["write", "write", "read", "list", "stat"])
            return {
                "op": op,
                "nth": self.rng.randint(1, 12),
                "error": self.rng.choice(["EIO", "timeout", "reset"]),
                "once": once,
            }
        if kind == "torn_write":
            return {"op": "write", "nth": self.rng.randint(1, 8), "path_contains": ".safetensors", "once": once}
        if kind == "disk_full":
            return {
                "op": "write",
                "nth": self.rng.randint(1, 6),
                "error": "ENOSPC",
                "path_contains": "iteration_",
                "once": once,
            }
        return {
            "op": self.rng.choice(["write", "read", "list"]),
            "nth": 1,
            "times": 0,  # slowed, never failed
            "delay_s": round(self.rng.uniform(0.02, 0.2), 3),
            "once": once,
        }

    # ------------------------------------------------------------------------- one submission

    def submit(self, root: CheckpointRoot, plan: Plan) -> harness.Outcome:
        n = self.submissions = self.submissions + 1
        marks, record = self.work / f"marks-{n}", str(self.work / f"storage-{n}.jsonl")
        marks.mkdir()
        cfg = job_config(root, str(self.work / "data"), self.options)
        committed = read_tracker(root.storage, root.uri)
        if committed is not None:
            cfg["checkpoint"]["load_path"] = root.uri  # as a resubmission of the job would
        remaining = (STEPS - (committed or 0)) * self.step_s
        notice = (
            soak_faults.NoticeAt(str(marks) + ".notice-at", str(marks) + ".notice")
            if plan.notice_at is not None
            else None
        )
        fired: dict = {}
        backend = harness.LocalBackend(
            storage_faults=([f for _, f in plan.storage], record) if plan.storage else None,
            setup=(soak_faults.prepare, self.journal, self.job_log, self.mutations),
            preempted=notice or harness.never,
            inspect=lambda controller: fired.update(phase_at=controller.fault_fired()),
        )
        log_at = os.path.getsize(self.job_log) if os.path.exists(self.job_log) else 0
        done = threading.Event()
        timed = threading.Thread(target=self.fire_timed, args=(plan, backend, marks, root, remaining, done, cfg))
        timed.start()
        try:
            loss = functools.partial(soak_faults.slow_loss, str(marks), STEP_SLEEP)
            api.train(cfg, loss=loss, backend=backend, fault=plan.phase)
        except (TrainingFailed, *USER_ERRORS) as exc:
            if backend.outcome is None:
                raise SoakFailure(f"submission {n} was refused before it ran: {exc}") from exc
        finally:
            done.set()
            timed.join()
        self.sigterm_sent = False
        if self.sigterm_dropped:  # it came as the job ended: no fault
            self.sigterm_dropped = False
            last = max((i for i, f in enumerate(self.faults) if f.kind == "sigterm"), default=None)
            if last is not None:
                del self.faults[last]
        if self.timed_error:
            error, self.timed_error = self.timed_error, None
            raise error
        ended = time.time()
        outcome = backend.outcome
        if outcome.driver_killed and read_tracker(root.storage, root.uri) is not None:
            self.killed_jobs.add(self.lease_holders(root)[-1][1])
        fired["driver_said"] = f"[fault] killing the driver (pid {backend.driver_pid})" in self.job_log_since(log_at)
        self.count_installed(plan, fired, record, str(marks) + ".notice", ended)
        self.after_stop(root, committed)
        return outcome

    def count_installed(self, plan: Plan, fired: dict, record: str, notice: str, ended: float) -> None:
        """The faults that were set up before the submission and fired during it."""
        if plan.phase_kind:  # the controller's claim, or its own word that it killed the driver (then it cannot answer)
            at = fired.get("phase_at")
            if plan.phase["phase"] in ("commit_before_tracker", "retention_delete") and fired.get("driver_said"):
                at = ended
            if at:
                self.faults.append(Fault(plan.phase_kind, self.rounds, at, json.dumps(plan.phase)))
        hits = storage_faults._lines(record) if os.path.exists(record) else []
        for kind, spec in plan.storage:  # each fault's `once` names it
            hit = next((h for h in hits if h.get("once") == spec["once"]), None)
            if hit:
                self.faults.append(Fault(kind, self.rounds, hit["at"], f"{hit['method']} {Path(hit['path']).name}"))
        if os.path.exists(notice):
            self.faults.append(Fault("preemption_notice", self.rounds, os.path.getmtime(notice)))

    def job_log_since(self, offset: int) -> str:
        with open(self.job_log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def fire_timed(self, *args) -> None:
        try:
            self._fire_timed(*args)
        except BaseException as exc:  # raised in the main thread once the submission has ended
            self.timed_error = exc

    def _fire_timed(
        self, plan: Plan, backend, marks: Path, root: CheckpointRoot, remaining: float, done: threading.Event, cfg: dict
    ) -> None:
        while not self.training(marks, 0):
            if done.wait(0.01):
                return
        began = time.time()
        if plan.notice_at is not None:  # when the ranks' NoticeAt gives the notice
            Path(str(marks) + ".notice-at").write_text(str(began + plan.notice_at * remaining))
        for kind, fraction in sorted(plan.timed, key=lambda t: t[1]):
            if done.wait(max(0.0, began + fraction * remaining - time.time())):
                return
            detail = self.inject(kind, backend, marks, root, cfg)
            if detail is not None:
                self.faults.append(Fault(kind, self.rounds, time.time(), detail))
                if kind in ENDS_SUBMISSION:
                    return

    @staticmethod
    def training(marks: Path, since: float) -> list[int]:
        """Pids of the ranks that computed a loss since `since`."""
        out = []
        for mark in marks.iterdir():
            try:
                if mark.stat().st_mtime >= since and psutil.pid_exists(int(mark.name)):
                    out.append(int(mark.name))
            except FileNotFoundError:
                pass
        return out

    def inject(self, kind: str, backend, marks: Path, root: CheckpointRoot, cfg: dict) -> str | None:
        """Inject one timed fault; what was done, or None if the job was not training any more."""
        ranks = self.training(marks, time.time() - 1.0)
        if not ranks:
            return None
        if kind in ENDS_SUBMISSION:
            self.committed_seen = read_tracker(root.storage, root.uri)
        if kind in ("rank_killed", "driver_killed"):
            victim = self.victims.choice(sorted(ranks)) if kind == "rank_killed" else backend.driver_pid
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:  # it had died meanwhile, of another fault
                return None
            return f"pid {victim}"
        if kind == "sigterm":
            self.sigterm_sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # to the driver: this process runs the job's launch
            return "to the driver"
        if kind == "power_cut":
            return self.power_cut(root)
        if kind == "second_job":
            return self.second_job(root, backend, cfg)
        raise ValueError(kind)

    def power_cut(self, root: CheckpointRoot) -> str:
        """On object storage, what a PUT acknowledged is kept: the cut only kills."""
        seen: dict = {"lost": []}

        def cut() -> None:
            seen["tracker"] = read_tracker(root.storage, root.uri)
            if self.options is None:
                seen["lost"] = soak_faults.lose_unsynced(root.uri, self.journal)

        soak_faults.freeze_and_kill(job_processes(), cut)
        self.check_tracker(root, seen["tracker"], "after a power cut")
        return f"{len(seen['lost'])} files lost bytes"

    def second_job(self, root: CheckpointRoot, backend, cfg: dict) -> str | None:
        """The same job submitted again while it runs: refused at the lease, before anything is read or written."""
        holder = self.lease_holders(root)[-1][1]
        second = dict(cfg, checkpoint={**cfg["checkpoint"], "load_path": root.uri})
        try:
            api.train(second, backend=_MustNotRun())
        except CheckpointError as exc:
            self.checked["second_job"] += 1
            if f"is being written by job {holder}" not in str(exc):
                raise SoakFailure(f"the second job was refused for another reason: {exc}") from exc
            left = self.lease_holders(root)
            if {job for _, job, _ in left} != {holder}:
                raise SoakFailure(f"the refused second job changed the lease: {left}") from exc
            return f"refused: job {holder} holds the lease"
        except _SecondJobRan:
            if psutil.pid_exists(backend.driver_pid) and backend.outcome is None:
                raise SoakFailure(f"a second job on {root.uri} was not refused while job {holder} ran") from None
        return None  # the first job had ended meanwhile: no fault

    @staticmethod
    def lease_holders(root: CheckpointRoot) -> list[tuple[str, str, bool]]:
        """(file, job, released) of every lease generation, oldest first."""
        lease_dir = paths.join(root.uri, LEASE_DIR)
        out = []
        for name in sorted(n for n in root.storage.listdir(lease_dir) if n.endswith(".json") and n[:-5].isdigit()):
            held = json.loads(root.storage.read_bytes(paths.join(lease_dir, name)))
            out.append((name, held.get("job_id"), held.get("released") is True))
        return out

    # ------------------------------------------------------------------------- checks

    def after_stop(self, root: CheckpointRoot, committed_before: int | None) -> None:
        deadline = time.monotonic() + 10
        while job_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.check("processes", not job_processes(), f"processes left after the job stopped: {job_processes()}")
        seen = [s for s in (committed_before, self.committed_seen) if s is not None]
        self.committed_seen = None
        self.check_tracker(root, max(seen, default=None), "after the job stopped")

    def check(self, invariant: str, ok: bool, message: str) -> None:
        self.checked[invariant] += 1
        if not ok:
            raise SoakFailure(f"{INVARIANTS[invariant]}: {message}")

    def check_tracker(self, root: CheckpointRoot, committed_before: int | None, when: str) -> None:
        tracker = read_tracker(root.storage, root.uri)
        if committed_before is not None:
            self.check(
                "no_commit_lost",
                tracker is not None and tracker >= committed_before,
                f"{when}, the tracker names {tracker}; iteration {committed_before} was committed before",
            )
        if tracker is None:
            return
        self.check_iteration(root, tracker, when)

    def check_iteration(self, root: CheckpointRoot, step: int, when: str) -> None:
        try:
            problems = verify_iteration(root.storage, root.iteration(step))["problems"]
        except CheckpointError as exc:
            problems = [str(exc)]
        self.check("tracker", not problems, f"{when}, iteration {step} does not verify: {problems}")
        same = committed_state(root, step) == self.reference[step]
        self.check("bytes", same, f"{when}, iteration {step} differs from the reference's")

    def check_round(self, root: CheckpointRoot) -> None:
        records = read_metrics(root.uri, self.options)
        runs = step_runs(records)
        starts = sorted((r["time"], r["step"]) for r in records if r.get("event") == "start" and r["rank"] == 0)
        last_start = starts[-1][1]
        self.check("losses", sorted(runs) == list(range(1, STEPS + 1)), f"steps run: {sorted(runs)}")
        for step, step_runs_ in runs.items():
            expected = self.reference_steps[step]
            for run in step_runs_:
                self.check(
                    "losses",
                    run["loss"] == expected["loss"] and set(run["ids"]) <= set(expected["ids"]),
                    f"step {step}: loss {run['loss']} and samples {run['ids']}, the reference's {expected['loss']} "
                    f"and {expected['ids']}",
                )
            # run by the group that finished the job (a killed rank's last records may be missing)
            if step > last_start:
                self.check(
                    "final_samples",
                    step_runs_[-1]["ids"] == expected["ids"],
                    f"step {step}: its last run consumed {step_runs_[-1]['ids']}, the reference {expected['ids']}",
                )
            self.timeline += [(self.rounds, run["time"], step) for run in step_runs_]
        by_job: dict[str, list[int]] = {}
        for step in iteration_steps(root.storage, root.uri):
            try:
                job = root.iteration(step).ours["job_id"]
            except CheckpointError as exc:
                raise SoakFailure(f"{INVARIANTS['leftovers']}: iteration {step} is left uncommitted: {exc}") from exc
            by_job.setdefault(job, []).append(step)
            self.check_iteration(root, step, "at the end")
        newest = max(max(steps) for steps in by_job.values())
        allowed = {job: SAVE_MAX + (job in self.killed_jobs) for job in by_job}
        self.check(
            "save_max",
            newest == STEPS and all(len(steps) <= allowed[job] for job, steps in by_job.items()),
            f"the root keeps iterations {by_job} by job; each may keep {allowed}",
        )
        if self.options is None:  # object storage has no temporary names: a PUT is whole or absent
            temporary = [str(p.relative_to(root.uri)) for p in Path(root.uri).rglob("*") if ".tmp" in p.name]
            self.check("leftovers", not temporary, f"temporary files left: {temporary}")
        newest, _, released = self.lease_holders(root)[-1]
        self.check("leftovers", released, f"lease {newest} of {root.uri} is still held")

    # ------------------------------------------------------------------------- rounds

    def run_round(self, pending: list[str]) -> None:
        self.rounds += 1
        on_s3 = self.s3 is not None and self.rounds % 2 == 0  # every other round, if there is an S3 server
        self.options = self.s3 if on_s3 else None
        self.s3_rounds += on_s3
        root = root_for(
            f"s3://ckpts/round-{self.rounds}/ckpt" if on_s3 else str(self.work / f"round-{self.rounds}" / "ckpt"),
            self.options,
        )
        for _ in range(MAX_SUBMISSIONS):
            committed = read_tracker(root.storage, root.uri)
            plan = self.draw(committed or 0, pending)
            outcome = self.submit(root, plan)
            fired = {f.kind for f in self.faults}
            pending[:] = [k for k in pending if k not in fired]
            if outcome.error is None and not outcome.driver_killed and read_tracker(root.storage, root.uri) == STEPS:
                break  # (a job resubmitted after its last commit has nothing to do: it commits nothing)
        else:
            raise SoakFailure(f"round {self.rounds} did not finish in {MAX_SUBMISSIONS} submissions")
        self.check_round(root)
        self.attribute_lost_time()
        for uri in (root.uri, metrics_dir(root.uri)):
            root.storage.remove_tree(uri)

    def attribute_lost_time(self) -> None:
        """Each fault of this round: the time from it until the job had done SAVE_EVERY more steps than it had
        when the fault hit (fewer at the round's end), less those steps' undisturbed time: a fault that
        stopped nothing lost about 0, one that stopped the job its restart, reload and redone steps.
        Overlapping faults share their loss. None for a fault after the last step."""
        steps = sorted((t, s) for r, t, s in self.timeline if r == self.rounds)
        for fault in (f for f in self.faults if f.round == self.rounds):
            reached = max((s for t, s in steps if t <= fault.at), default=0)
            target = min(reached + SAVE_EVERY, STEPS)
            back = next((t for t, s in steps if t > fault.at and s >= target), None)
            if back is not None and target > reached:
                fault.lost_s = max(0.0, back - fault.at - (target - reached) * self.step_s)


class _SecondJobRan(Exception):
    pass


class _MustNotRun:
    """The second job's backend: reaching it means the lease let the job in."""

    def run(self, cfg, plan, launch, loop_config):
        raise _SecondJobRan()


# ----------------------------------------------------------------------------- report


def summary(soak: Soak, seconds: float, failure: str | None, interrupted: bool = False) -> dict:
    by_kind = {}
    for kind in KINDS:
        faults = [f for f in soak.faults if f.kind == kind]
        lost = [f.lost_s for f in faults if f.lost_s is not None]
        survived = len(faults) if failure is None and not interrupted else sum(f.round < soak.rounds for f in faults)
        by_kind[kind] = {
            "injected": len(faults),
            "survived": survived,
            "lost_median_s": round(statistics.median(lost), 2) if lost else None,
            "lost_worst_s": round(max(lost), 2) if lost else None,
        }
    return {
        "seed": soak.seed,
        "seconds": round(seconds, 1),
        "rounds": soak.rounds,
        "rounds_on_s3": soak.s3_rounds,
        "submissions": soak.submissions,
        "faults": len(soak.faults),
        "kinds": sum(1 for k in by_kind.values() if k["injected"]),
        "by_kind": by_kind,
        "checked": dict(soak.checked),
        "failure": failure,
        "interrupted": interrupted,
        "mutations": list(soak.mutations),
        "injected": [asdict(f) for f in soak.faults],
    }


def print_report(report: dict) -> None:
    print(
        f"soak: seed {report['seed']}, {report['seconds'] / 60:.1f} min, {report['rounds']} rounds "
        f"({report['rounds_on_s3']} on S3), "
        f"{report['submissions']} submissions, {report['faults']} faults of {report['kinds']} kinds"
    )
    print("| fault | injected | survived | time lost, median | worst |")
    print("|---|---|---|---|---|")
    for kind, row in report["by_kind"].items():
        if row["injected"]:
            median = "" if row["lost_median_s"] is None else f"{row['lost_median_s']:.2f} s"
            worst = "" if row["lost_worst_s"] is None else f"{row['lost_worst_s']:.2f} s"
            print(f"| {kind} | {row['injected']} | {row['survived']} | {median} | {worst} |")
    print("| invariant | checked |")
    print("|---|---|")
    for name, text in INVARIANTS.items():
        print(f"| {text} | {report['checked'].get(name, 0)} |")
    if report["failure"]:
        print(f"SOAK FAILED (seed {report['seed']}, round {report['rounds']}): {report['failure']}")
    elif report["interrupted"]:
        print(f"soak interrupted in round {report['rounds']}: its faults are not counted as survived")


def plot(soak: Soak, start: float, path: str, failure: str | None, window_s: float = 90) -> None:
    """Above, the soak's first `window_s` seconds: each step run (the round's step over time; a fall is a
    resume from an earlier commit, or the next round) and each fault as a line of its kind's colour.
    Below, the faults injected so far over the whole soak, by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (near, whole) = plt.subplots(2, 1, figsize=(11, 7.5))
    first = min((t for _, t, _ in soak.timeline), default=start)
    points = sorted((t - first, s) for _, t, s in soak.timeline if t - first <= window_s)
    near.plot([t for t, _ in points], [s for _, s in points], "-o", color="0.35", markersize=1.8, linewidth=0.4)
    colors = {kind: plt.get_cmap("tab20")(i) for i, kind in enumerate(KINDS)}
    for kind in KINDS:
        at = [f.at - first for f in soak.faults if f.kind == kind and 0 <= f.at - first <= window_s]
        if at:
            near.vlines(at, 0, STEPS, color=colors[kind], linewidth=1.2, label=kind)
    near.set_xlabel(f"seconds (the first {window_s:.0f} s)")
    near.set_ylabel("step of the round")
    near.set_title(f"soak, seed {soak.seed}: each step run, and each fault as it hit")
    near.legend(fontsize=6, ncol=4, loc="lower right")
    for kind in KINDS:
        at = sorted((f.at - start) / 60 for f in soak.faults if f.kind == kind)
        if at:
            whole.step(at, range(1, len(at) + 1), where="post", color=colors[kind], linewidth=1, label=kind)
    at = sorted((f.at - start) / 60 for f in soak.faults)
    whole.step(at, range(1, len(at) + 1), where="post", color="black", linewidth=1.6, label="all")
    whole.set_xlabel("minutes")
    whole.set_ylabel("faults injected")
    whole.set_title(
        f"{len(soak.faults)} faults of {len({f.kind for f in soak.faults})} kinds in {soak.rounds} rounds, "
        + ("all survived" if failure is None else "FAILED: " + failure[:80])
    )
    whole.legend(fontsize=6, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=None, help="run this long (whole rounds)")
    parser.add_argument("--cover", action="store_true", help="stop once every kind has been injected")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to inject (default: all)")
    parser.add_argument(
        "--mutate", default="", help=f"break the product on purpose: {', '.join(soak_faults.MUTATIONS)}"
    )
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--plot", default=None, help="draw progress and faults into this PNG")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    parser.add_argument(
        "--local-only",
        action="store_true",
        help="no S3 rounds (by default every other round is on an S3 server on loopback, moto: pip install -e .[test])",
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    mutations = tuple(m for m in args.mutate.split(",") if m)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("ray_resume", "werkzeug"):  # the soak's own lines, not every submission's nor the S3 server's requests
        logging.getLogger(name).setLevel(logging.ERROR)
    work = Path(args.dir or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(work, args.seed, kinds, mutations)
    signal.signal(signal.SIGTERM, soak.on_sigterm)
    server = None
    if not args.local_only:
        server, soak.s3 = s3_server.start("ckpts")  # a moto server on loopback, with the bucket
    start = time.time()
    soak.make_reference()
    pending = list(kinds) if args.cover else []
    failure = None
    said, interrupted = start, False
    try:
        while True:
            soak.run_round(pending)
            elapsed = time.time() - start
            if time.time() - said >= PROGRESS_EVERY_S:
                said = time.time()
                print(
                    f"soak: {elapsed / 60:5.1f} min, round {soak.rounds}, {len(soak.faults)} faults survived",
                    flush=True,
                )
            if args.cover and not pending or args.rounds and soak.rounds >= args.rounds:
                break
            if args.minutes is not None and elapsed >= args.minutes * 60:
                break
            if args.minutes is None and not args.cover and not args.rounds:
                break
    except SoakFailure as exc:
        failure = str(exc)
    except Exception as exc:  # the soak itself broke: reported as a failure too, with where
        traceback.print_exc()
        failure = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:  # Ctrl-C, or a SIGTERM not the soak's own: the report of the rounds done
        interrupted = True
    if server is not None:
        server.stop()
    report = summary(soak, time.time() - start, failure, interrupted)
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(soak, start, args.plot, failure)
    if not args.dir and failure is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failure else 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
