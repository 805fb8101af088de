"""What a run tells its user: the summary at the end and the TensorBoard curves (harness), and the
console of a real run on Ray Train with a worker lost (tests/test_whole_job.py)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import harness
from conftest import FINAL, KILL_AT_6, env_for_subprocess, per_step, read_metrics, shard_bytes, tiny_config
from ray_resume.summary import Reached, summarize


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the event files under `directory`, read as TensorBoard reads them:
    file by file in name order, an event of a purging session dropping the later steps before it."""
    from tensorboardX.proto import event_pb2

    curves: dict[str, dict[int, float]] = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                for values in curves.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                curves.setdefault(value.tag, {})[event.step] = value.simple_value
    return curves


def test_a_restarted_run_ends_with_a_summary_and_one_curve_in_tensorboard(tmp_path, local_reference):
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    outcome = harness.run_job(cfg, fault=KILL_AT_6, controller="CommitsFirst")  # 4 committed before the kill
    assert outcome.attempts == 2
    [job] = {r["job"] for r in read_metrics(root)}

    lines = summarize(read_metrics(root), list(outcome.reached), job_id=job, global_batch_size=16, wall_s=10.0)
    assert lines[0] == f"{FINAL} steps (1-{FINAL}) in 10.0 s: {FINAL * 16 / 10:.0f} samples/s overall"
    assert lines[1].startswith("3 saves; training blocked ") and lines[1].endswith(" s at most (any rank)")
    reached = outcome.reached[0].step
    assert reached in (5, 6)  # rank 0 finished 5 or 6 before the group was ended
    assert lines[2].startswith(f"1 restart: after step {reached}: resumed from 4, {reached - 4} steps redone, ")
    # The restart's cost part by part (the harness has no Ray Train to notice the loss: no "noticed" part).
    assert (
        re.fullmatch(
            r".* s lost \(new processes \d+\.\d s, imports and setup \d+\.\d s, build and restore \d+\.\d s, "
            r"first batch \d+\.\d s, first step \d+\.\d s, redoing \d+\.\d s\)",
            lines[2],
        )
        and len(lines) == 3
    ), lines[2]
    [restart] = [r for r in read_metrics(root) if r.get("event") == "restart"]
    assert (restart["attempt"], restart["rank"], restart["step"], restart["caught_up"]) == (1, 0, 4, reached)
    # The line shows the record's parts, and the parts account for the time lost: each one a stretch
    # the new group spent (a new process started, imported, built and restored, stepped), together
    # all of it but the gaps between them and the first step beyond the lost ones: never more (a part
    # counted twice), never much less (a part left out).
    shown = dict(
        re.findall(
            r"(new processes|imports and setup|build and restore|first batch|first step|redoing) (\d+\.\d) s", lines[2]
        )
    )
    keys = {
        "new processes": "spawn_s",
        "imports and setup": "setup_s",
        "build and restore": "restore_s",
        "first batch": "first_batch_s",
        "first step": "first_step_s",
        "redoing": "redo_s",
    }
    assert {label: f"{restart[key]:.1f}" for label, key in keys.items()} == shown
    assert all(restart[key] > 0 for key in ("spawn_s", "setup_s", "restore_s", "first_step_s"))
    lost = float(re.search(r"steps redone, (\d+\.\d) s lost", lines[2]).group(1))
    parts = sum(restart[key] for key in keys.values())
    assert 0.5 * lost <= parts <= lost + 0.05, (parts, lost)  # `lost` is shown to 0.1 s

    events = Path(f"{root}-metrics") / "tensorboard" / job
    assert len(list(events.glob("events.out.tfevents.*"))) == 2  # one per attempt
    curves = tensorboard_scalars(events)
    losses = {step: runs[-1]["loss"] for step, runs in per_step(read_metrics(root)).items()}
    assert sorted(curves["loss"]) == list(range(1, FINAL + 1))
    assert all(abs(curves["loss"][s] - losses[s]) < 1e-5 for s in losses)  # float32 in the events
    assert losses == {s: runs[-1]["loss"] for s, runs in local_reference["steps"].items()}  # the reference's
    assert curves["attempt"] == {0: 0.0, 4: 1.0}  # the restart, where it resumed
    assert set(curves["save_stall_s"]) == {4, 8, FINAL} and set(curves["lr"]) == set(range(1, FINAL + 1))
    assert sorted(curves["grad_norm"]) == list(range(1, FINAL + 1)) and all(v > 0 for v in curves["grad_norm"].values())


def test_a_restarts_new_group_time_splits_where_its_process_started():
    from ray_resume.summary import restart_clock

    # Last step at 10, noticed at 10.5, rank 0's process started at 11, the new group called at 18.
    assert restart_clock(10.0, 10.5, 11.0, 18.0) == {"detect_s": 0.5, "spawn_s": 0.5, "setup_s": 7.0}
    # A process Ray had started before the loss: all of the new group's time is its setup.
    assert restart_clock(10.0, 10.5, 9.0, 18.0) == {"detect_s": 0.5, "spawn_s": 0.0, "setup_s": 7.5}
    assert restart_clock(10.0, 10.5, None, 18.0) == {"detect_s": 0.5, "new_group_s": 7.5}
    assert restart_clock(10.0, None, 12.0, 18.0) == {"spawn_s": 2.0, "setup_s": 6.0}  # no failure report (the harness)


def test_the_first_start_splits_at_the_drivers_stamps_and_where_rank_0s_process_started():
    from ray_resume.summary import start_clock, summarize

    # Launched at 0, checks done at 1.5, Ray up at 4, fit() at 4.5, rank 0's process at 7, its first call at 12.
    driver = {"launched": 0.0, "checked": 1.5, "ray_up": 4.0, "fit": 4.5}
    assert start_clock(driver, 7.0, 12.0) == {
        "checks_s": 1.5,
        "ray_s": 2.5,
        "actors_s": 0.5,
        "spawn_s": 2.5,
        "setup_s": 5.0,
    }
    # no Ray Train
    assert start_clock({"launched": 0.0, "checked": 1.5}, None, 12.0) == {"checks_s": 1.5, "new_group_s": 10.5}
    started = {
        "job": "j",
        "rank": 0,
        "attempt": 0,
        "event": "started",
        "step": 0,
        "checks_s": 1.5,
        "ray_s": 2.5,
        "actors_s": 0.5,
        "spawn_s": 2.5,
        "setup_s": 5.0,
        "restore_s": 1.0,
        "first_batch_s": 0.25,
        "first_step_s": 0.75,
    }
    steps = [{"job": "j", "rank": 0, "attempt": 0, "step": s, "loss": 1.0, "time": 20.0 + s} for s in (1, 2)]
    lines = summarize([started, *steps], [Reached(0, 2, 22.0)], job_id="j", global_batch_size=4, wall_s=30.0)
    assert lines[1] == (
        "start: 14.0 s to the end of the first step (checks 1.5 s, Ray 2.5 s, our actors 0.5 s, new processes 2.5 s, "
        "imports and setup 5.0 s, build and restore 1.0 s, first batch 0.2 s, first step 0.8 s)"
    ), lines


def test_process_started_is_when_the_process_began_not_when_it_asked():
    import subprocess
    import sys
    import time

    before = time.time()
    asked = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(1.0); from ray_resume.rank import process_started; "
            "print(process_started(), time.time())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    started, now = map(float, asked.stdout.split())
    assert before - 0.05 <= started <= now - 1.0  # /proc counts in 10 ms ticks


def test_grad_norm_is_torchs_total_norm_and_changes_no_gradient():
    import torch

    from ray_resume.model import GPT
    from ray_resume.optim import grad_norm

    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    model(torch.randint(0, 32, (2, 8))).float().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert abs(grad_norm(model.parameters()) - expected) < 1e-5 * expected
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


def test_only_rank_0_writes_the_curve_the_others_what_differs(tmp_path, local_reference):
    """Metrics that scale: without log_sample_ids the other ranks write their start (bytes read) and
    their save stalls, in chunks rolled over by time, not a chunk every few steps."""
    cfg = tiny_config(tmp_path, training={"log_sample_ids": False, "log_every": 1})
    cfg["data"]["path"] = local_reference["data"]
    root = cfg["checkpoint"]["save_path"]
    assert harness.run_job(cfg).error is None
    chunks = sorted(p.name for p in Path(f"{root}-metrics").glob("*.jsonl"))
    rank1 = [r for r in read_metrics(root) if r["rank"] == 1]
    assert len([c for c in chunks if "-rank00001-" in c]) == 2  # its start, and its last chunk at the end
    assert len([c for c in chunks if "-rank00000-" in c]) >= FINAL  # the curve: a chunk per logged step
    assert [r["event"] for r in rank1 if "event" in r] == ["start", "save_wait"]
    assert [r["step"] for r in rank1 if r.get("saved")] == [4, 8, FINAL] and not any("loss" in r for r in rank1)
    steps = [r["step"] for r in read_metrics(root) if r["rank"] == 0 and "loss" in r]
    assert steps == list(range(1, FINAL + 1))


def test_evaluation_is_reported_and_changes_nothing_in_training(tmp_path, local_reference):
    """Eval loss on a held-out set every 4 steps, in a job killed at step 6: the training bytes are
    the reference run's (which never evaluated), the eval losses those of a clean run with evaluation,
    and they are in the metrics, the curves and the plot's data."""
    from ray_resume.plot import read_records, summarize as plotted

    def config(where, **sections):
        cfg = tiny_config(where, training={"eval_every": 4}, **sections)
        cfg["data"].update(path=local_reference["data"], eval_path=local_reference["data"])
        return cfg

    killed = config(tmp_path / "killed")
    assert harness.run_job(killed, fault=KILL_AT_6).attempts == 2
    clean = config(tmp_path / "clean")
    assert harness.run_job(clean).error is None
    root = killed["checkpoint"]["save_path"]
    for step in (4, 8, FINAL):
        assert shard_bytes(root, step) == shard_bytes(local_reference["root"], step), step

    def evals(cfg):
        return {
            r["step"]: (r["eval_loss"], r["samples"])
            for r in read_metrics(cfg["checkpoint"]["save_path"])
            if r.get("event") == "eval"
        }

    assert sorted(evals(killed)) == [4, 8, FINAL] and evals(killed) == evals(clean)
    assert {s for s, (_, n) in evals(killed).items() if n == 160} == {4, 8, FINAL}  # all 160 held-out samples
    assert plotted(read_records(root))["evals"] == {s: loss for s, (loss, _) in evals(killed).items()}
    [job] = {r["job"] for r in read_metrics(root)}
    curve = tensorboard_scalars(Path(f"{root}-metrics") / "tensorboard" / job)["eval_loss"]
    assert {s: round(v, 4) for s, v in curve.items()} == {s: round(loss, 4) for s, (loss, _) in evals(killed).items()}


def test_two_chunks_flushed_within_one_millisecond_are_both_kept(tmp_path, monkeypatch):
    """A restart record and the next step's record, flushed back to back, once shared a file name."""
    from ray_resume import metrics

    monkeypatch.setattr(metrics.time, "time", lambda: 1764590000.123)
    writer = metrics.MetricsWriter(str(tmp_path / "ckpt"), None, job="j", attempt=1, rank=0)
    for step in (5, 6):
        writer.add({"step": step})
        writer.flush()
    assert sorted(r["step"] for r in read_metrics(str(tmp_path / "ckpt"))) == [5, 6]


def test_a_restarted_groups_progress_lines_are_printed_not_folded_by_rays_log_deduplication():
    """Ray's driver folds lines of one shape from several processes within 5 s into one "[repeated
    Nx across cluster]": a new rank 0's first progress lines after a fast restart went missing (the
    console test caught it in CI). Importing ray_resume before Ray (as `python -m ray_resume.run`
    does) lets every line of a job's own through, by Ray's public setting; the rest is still folded.
    In a fresh interpreter: Ray reads the setting once, as it is imported."""
    script = """
import json, os, sys
if sys.argv[1] == "ours":
    import ray_resume
from ray._private.ray_logging import stdout_deduplicator as dedup
dedup.timesource = lambda: 0.0
def said(pid, line):
    return [text for out in dedup.deduplicate({"ip": "127.0.0.1", "pid": pid, "lines": [line]}) for text in out["lines"]]
lost, restarted = "[tiny] step 6/12 | loss 4.1 | 300 samples/s", "[tiny] step 5/12 | loss 4.2 | 250 samples/s"
other = "(pid) something 1 of Ray's own"
print(json.dumps([said(1, lost), said(2, restarted), said(1, other), said(2, other.replace("1", "2"))]))
"""
    env = env_for_subprocess()
    env.pop("RAY_DEDUP_LOGS_ALLOW_REGEX", None)  # this process imported ray_resume, which sets it

    def run(mode):
        done = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    lost, restarted = "[tiny] step 6/12 | loss 4.1 | 300 samples/s", "[tiny] step 5/12 | loss 4.2 | 250 samples/s"
    other = "(pid) something 1 of Ray's own"
    assert run("ray alone") == [[lost], [], [other], []]  # Ray's own behaviour: the restarted line folded
    assert run("ours") == [[lost], [restarted], [other], []]
