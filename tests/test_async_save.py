"""Async checkpoint save: same bytes as a sync save, reused buffers, errors that surface, crash safety.

These drive the real `Checkpointer.maybe_save` without Ray: a stand-in for
the job's controller records the manifests it is sent. End to end, the Ray
reference run saves asynchronously (the default) and the sync-saving faulty
runs of tests/test_resume_e2e.py end byte-identical to it; a kill while an
async write is in flight is tests/test_harness.py's mid_shard_write case.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import storage_faults
from conftest import commit_by_hand, shard_bytes, tiny_config
from ray_resume.checkpoint import checkpointer as checkpointer_module
from ray_resume.checkpoint.async_choice import AsyncChoice
from ray_resume.checkpoint.format import state
from ray_resume.errors import AsyncSaveError
from ray_resume.checkpoint.checkpointer import Checkpointer
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.reader import ShardReader, load_rank_extras
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.format.schema import local_shape
from ray_resume.checkpoint.io import storage as storage_module
from ray_resume.checkpoint.io import writer_process
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import RANK_EXTRAS_KEY, live_data, safetensors_header, shard_layouts
from ray_resume.config import Config
from ray_resume.faults import Fault, FaultInjector
from test_checkpoint_format import make_state


class FakeCoordinator:
    """Stands in for the job's controller: records the manifests it is sent."""

    def __init__(self):
        self.reports: list[tuple] = []
        self.threads: set[str] = set()

    def report(self, attempt, step, manifest, common):
        self.reports.append((attempt, step, manifest, common))
        self.threads.add(threading.current_thread().name)
        return True


def checkpointer_for(root: Path, rank: int, world: int, *, coordinator=None, **checkpoint):
    cfg = Config.from_dict(
        tiny_config(root.parent, checkpoint={"save_path": str(root), "save_interleaved_steps": 1, **checkpoint})
    )
    return Checkpointer(
        cfg.checkpoint,
        coordinator or FakeCoordinator(),
        rank,
        world,
        attempt=0,
        faults=FaultInjector(None, rank, lambda: True),
    )


def files_of(root: Path, step: int) -> dict[str, bytes]:
    return shard_bytes(root, step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_shards_are_exactly_what_safetensors_writes(dtype):
    """Our header + raw data section is byte for byte `safetensors.torch.save` of the same pieces."""
    model, opt = make_state(dtype=dtype)
    states = {"model": state.model_tensors(model), "opt": opt.state_tensors()}
    for world in (1, 2, 3):
        for rank in range(world):
            assert [shard.kind for shard in shard_layouts(states, rank, world)] == ["model", "opt"]
            for shard in shard_layouts(states, rank, world):
                extras = {RANK_EXTRAS_KEY: '{"rng": "x\\"y"}'} if shard.kind == "opt" else None
                ours = b"".join(
                    bytes(c) for c in [safetensors_header(shard, extras), *live_data(shard, states[shard.kind])]
                )
                # Each piece a box of rows, in its own shape (what MindFormers' metadata calls local_shape).
                pieces = {
                    e.piece.name: states[shard.kind][e.piece.name]
                    .reshape(-1)[e.piece.start : e.piece.start + e.piece.numel]
                    .reshape(local_shape(e.spec, e.piece))
                    .clone()
                    for e in shard.entries
                }
                assert ours == safetensors.torch.save(pieces, metadata=extras), (shard.kind, rank, world)


# How a save is written: on the training thread, by the writer thread, or by a writer process.
MODES = {
    "sync": {"async_save": False},
    "thread": {"async_save": True, "async_writer": "thread"},
    "process": {"async_save": True, "async_writer": "process"},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.invariant(2)
def test_sync_thread_and_process_saves_write_identical_files(tmp_path, dtype):
    model, opt = make_state(dtype=dtype)
    common = {"global_step": 3}
    roots = {mode: tmp_path / mode / "ckpt" for mode in MODES}
    coordinators, writers, held = {}, {}, []
    for mode, root in roots.items():
        for rank in range(2):
            coordinators[mode, rank] = FakeCoordinator()
            ck = checkpointer_for(root, rank, 2, coordinator=coordinators[mode, rank], **MODES[mode])
            held.append(ck)  # a checkpointer dropped ends its writer
            torch.manual_seed(1234)  # same RNG state captured into the opt shard's header
            ck.save(3, model, opt, common)
            assert ck.last_stall_s is not None and ck.stalls[0][0] == 3
            ck.close()
            writers[mode, rank] = ck.writer.pid if ck.writer else None
    assert files_of(roots["sync"], 3) == files_of(roots["thread"], 3) == files_of(roots["process"], 3)
    assert len(files_of(roots["sync"], 3)) == 4
    # The writer thread reported, with the same manifest as the sync save, whoever wrote the files.
    for rank in range(2):
        (sync_report,), (thread_report,), (process_report,) = (coordinators[m, rank].reports for m in MODES)
        assert sync_report == thread_report == process_report
        for mode in ("thread", "process"):
            assert any(name.startswith(f"ckpt-writer-{rank}") for name in coordinators[mode, rank].threads)
        assert coordinators["sync", rank].threads == {threading.current_thread().name}
        # The process: this one's child, in the lowest scheduling class, without torch; none for the others.
        pid = writers["process", rank]
        assert writers["sync", rank] is writers["thread", rank] is None and pid is not None
        assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
    # And what was written loads back to the very state.
    commit_by_hand(roots["process"], 3, [coordinators["process", r].reports[0][2] for r in range(2)])
    it = open_iteration(LocalStorage(), str(roots["process"]), 3)
    for kind, held in (("model", state.model_tensors(model)), ("opt", opt.state_tensors())):
        loaded = load_state(LocalStorage(), it, kind)
        assert loaded.keys() == held.keys()
        for name, tensor in loaded.items():
            assert torch.equal(tensor, held[name]), name
    assert set(load_rank_extras(ShardReader(LocalStorage(), it), 1)) == {"rng_torch", "rng_numpy", "rng_python"}


@pytest.mark.parametrize(
    "after_async, waited, chosen",
    [(1.0, 0.0, True), (1.05, 0.0, False), (1.0, 0.45, False), (0.9, 0.45, False)],
    ids=["steps-as-fast", "steps-slower", "a-write-waited-for", "faster-steps-are-no-credit"],
)
def test_auto_weighs_a_sync_stall_against_an_async_one_and_what_the_steps_after_it_lost(after_async, waited, chosen):
    """Saves every 10 steps of 1 s: the sync save blocks 0.5 s, the async one 0.1 s. Async wins while the
    steps after it are as fast as after the sync save; not when they lose 0.05 s each, nor when the next
    save waits 0.45 s for its write, which steps that happened to run faster do not pay back."""
    choice = AsyncChoice()
    ways = []
    for step, entered, left in [(10, 0.0, 0.2), (20, 10.2, 10.7), (30, 20.7, 20.8)]:
        ways.append(choice.next_is_async())
        choice.saved(step, entered, left)
    assert ways == [False, False, True] and choice.next_is_async() is None
    verdict, why = choice.measure(40, 20.8 + 10 * after_async, waited)
    assert verdict is chosen
    if not waited and chosen:
        assert why == (
            "async: a sync save blocked training 0.500 s, an async one 0.100 s, the 10 steps after it took "
            "+0.000 s more than those after the sync save and the next save waited 0.000 s for its write "
            "(0.100 s in all)"
        )
    choice.decide(40, verdict, why)
    choice.saved(40, 30.0, 30.1)
    assert choice.next_is_async() is chosen and len(choice.timed) == 3


def test_async_save_auto_measures_three_saves_then_saves_the_cheaper_way_and_the_same_bytes(tmp_path):
    """`async_save: auto`: saves 1 and 2 sync (1 warms up the buffers), 3 async (reported by the writer
    thread), from 4 the way the measures say; every iteration's files are a sync checkpointer's."""
    model, opt = make_state()
    began = [p.detach().clone() for p in model.parameters()]
    ways = {}
    for mode, settings in (("auto", {"async_save": "auto", "async_writer": "thread"}), ("sync", MODES["sync"])):
        with torch.no_grad():
            for p, value in zip(model.parameters(), began):
                p.copy_(value)
        coordinator = FakeCoordinator()
        reported_by = []
        coordinator.report = lambda attempt, step, *rest, by=reported_by: by.append(
            (step, threading.current_thread().name)
        )
        ck = checkpointer_for(tmp_path / mode / "ckpt", 0, 1, coordinator=coordinator, **settings)
        for step in range(1, 7):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)  # a step: the save must hold this step's weights, not a later one's
            time.sleep(0.05)
            torch.manual_seed(step)
            ck.save(step, model, opt, {"global_step": step})
        ck.close()
        ways[mode] = sorted(reported_by)
        if mode == "auto":
            choice = ck.choice
    chose = choice.decided
    assert choice.decided_at == 4 and choice.why.startswith("async:" if chose else "sync:"), choice.why
    background = [name.startswith("ckpt-writer-0") for _, name in ways["auto"]]
    assert background == [False, False, True, chose, chose, chose]
    assert all(name == "MainThread" for _, name in ways["sync"])
    for step in range(1, 7):
        assert files_of(tmp_path / "auto" / "ckpt", step) == files_of(tmp_path / "sync" / "ckpt", step), step


def test_a_sync_verdict_ends_the_writer_process_and_frees_the_snapshot_buffers(tmp_path, monkeypatch):
    """Once `auto` chose sync, what only async saves use goes: the writer process the warm-up started,
    and the buffers the size of the rank's share."""
    monkeypatch.setattr(AsyncChoice, "measure", lambda self, step, now, waited: (False, "sync: as this test says"))
    model, opt = make_state()
    ck = checkpointer_for(tmp_path / "ckpt", 0, 1, async_save="auto", async_writer="process")
    for step in (1, 2, 3):
        ck.save(step, model, opt, {"global_step": step})
    writer = ck.writer.pid
    assert ck.snapshots.allocations == 2  # model and opt
    ck.save(4, model, opt, {"global_step": 4})
    assert ck.choice.decided is False and ck.writer is None and ck.snapshots.allocations == 0
    assert not Path(f"/proc/{writer}").exists()
    ck.close()


def test_the_writer_process_protocol_takes_its_own_messages_whole_and_nothing_else():
    """What a rank and its writer say crosses as the message class it is (`wire`); a message of another
    kind, or one missing a field, is refused where it arrives, naming what was wrong."""
    import json
    import socket
    import struct

    from ray_resume import wire

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    write = writer_process.Write(
        "xxh3", False, [writer_process.ToWrite("a/b", "model", "aGk=", [3], [0, 3], ["ab" * 16])]
    )
    wire.send(ours, write)
    assert wire.receive(theirs, (writer_process.Setup, writer_process.Write)) == (write, [])
    wire.send(ours, writer_process.Go())
    with pytest.raises(ConnectionError, match="expected Setup or Buffer, got 'Go'"):
        wire.receive(theirs, (writer_process.Setup, writer_process.Buffer))
    body = json.dumps({"op": "Buffer", "kind": "model"}).encode()
    ours.sendall(struct.pack("!I", len(body)) + body)
    with pytest.raises(ConnectionError, match="a malformed Buffer: .*'nbytes'"):
        wire.receive(theirs, (writer_process.Buffer,))


def test_auto_writes_a_small_share_in_the_thread_and_a_large_one_in_a_process(tmp_path, monkeypatch):
    model, opt = make_state()
    small = checkpointer_for(tmp_path / "small", 0, 1)  # async_writer: auto, the default
    assert small.writer is None  # decided at the first save, by the share's size
    small.save(1, model, opt, {"global_step": 1})
    small.close()
    assert small.writer is None and (tmp_path / "small" / "iteration_00000001").is_dir()
    monkeypatch.setattr(writer_process, "PROCESS_MIN_BYTES", 1)  # every share is large now
    large = checkpointer_for(tmp_path / "large", 0, 1)
    large.save(1, model, opt, {"global_step": 1})
    large.close()
    assert large.writer.pid is not None
    assert files_of(tmp_path / "small", 1).keys() == files_of(tmp_path / "large", 1).keys()


def test_a_writer_process_killed_mid_write_loses_that_save_only(tmp_path, caplog):
    """The writer dies half way through a file: that iteration is never reported (so never committed),
    one line says so, and the next save starts a new writer and writes the very bytes a sync save does."""
    model, opt = make_state()
    coordinator = FakeCoordinator()
    ck = checkpointer_for(tmp_path / "ckpt", 0, 1, coordinator=coordinator, **MODES["process"])
    killed = []

    def kill_the_writer(phase, step):
        if phase == "mid_shard_write" and step == 1 and not killed:
            killed.append(ck.writer.pid)
            os.kill(ck.writer.pid, signal.SIGKILL)

    ck.faults = FaultInjector(Fault("mid_shard_write", 1), 0, claim=lambda: True)  # armed: the write pauses half way
    ck.faults.maybe_kill = kill_the_writer
    ck.save(1, model, opt, {"global_step": 1})
    ck.close()  # no error: the save is lost, the training goes on
    assert coordinator.reports == []
    assert [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()] == [
        f"rank 0: iteration 1 is not saved: the writer process (pid {killed[0]}) ended (killed by SIGKILL) while writing "
        "ckpt-model-0000000-0000001.safetensors, ckpt-opt-0000000-0000001.safetensors; the next save starts a new writer"
    ]
    torch.manual_seed(7)
    ck.save(2, model, opt, {"global_step": 2})
    ck.close()
    assert [step for _, step, _, _ in coordinator.reports] == [2] and ck.writer.pid != killed[0]
    expected = checkpointer_for(tmp_path / "sync" / "ckpt", 0, 1, **MODES["sync"])
    torch.manual_seed(7)
    expected.save(2, model, opt, {"global_step": 2})
    assert files_of(tmp_path / "ckpt", 2) == files_of(tmp_path / "sync" / "ckpt", 2)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_storage_error_surfaces_the_same_from_the_thread_and_the_process(tmp_path, mode):
    """ENOSPC on a shard write (injected below the retries, in the writer process as in the rank) is
    raised at the next save as the same AsyncSaveError, its cause the same OSError; not retried."""
    record = str(tmp_path / "injected.jsonl")
    storage_faults.install([{"op": "write", "error": "ENOSPC", "path_contains": ".safetensors"}], record)
    try:
        model, opt = make_state()
        ck = checkpointer_for(tmp_path / "ckpt", 0, 1, **MODES[mode])
        ck.save(1, model, opt, {"global_step": 1})
        with pytest.raises(AsyncSaveError) as info:
            ck.close()
    finally:
        storage_module.wrappers.clear()
    path = tmp_path / "ckpt" / "iteration_00000001" / "ckpt-model-0000000-0000001.safetensors"
    assert str(info.value) == (
        "asynchronous checkpoint save of iteration 1 failed: OSError(28, 'injected ENOSPC on write')"
    )
    assert type(info.value.__cause__) is OSError and info.value.__cause__.errno == errno.ENOSPC
    assert [(f["method"], f["pid"] != os.getpid()) for f in storage_faults.injected(record)] == [
        ("write_durable", mode == "process")
    ], path


def test_the_writer_process_dies_with_its_rank(tmp_path):
    """A rank SIGKILLed leaves no writer behind (PR_SET_PDEATHSIG): nothing it wrote can be reported,
    and no process outlives the job."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parent.parent)]!r}
        from pathlib import Path
        from test_async_save import checkpointer_for, MODES
        from test_checkpoint_format import make_state
        model, opt = make_state()
        ck = checkpointer_for(Path({str(tmp_path / "ckpt")!r}), 0, 1, **MODES["process"])
        ck.save(1, model, opt, {{"global_step": 1}})
        ck.close()
        print(ck.writer.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


@pytest.mark.invariant(16)
def test_the_writer_process_is_reached_by_no_name_another_user_could_open(tmp_path):
    """The rank and its writer share a socketpair and memfds, handed over as file descriptors: no
    socket path, no abstract address, no file in /dev/shm or /tmp through which another uid could
    read a job's tensors, its storage credentials (the setup message) or inject a write."""
    model, opt = make_state()
    ck = checkpointer_for(tmp_path / "ckpt", 0, 1, **MODES["process"])
    shm_before = set(os.listdir("/dev/shm"))
    ck.save(1, model, opt, {"global_step": 1})
    ck.close()  # the write is done; the writer lives on with its buffers mapped and its socket open
    try:
        pid = ck.writer.pid
        links = {fd.name: os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        sockets = {int(link[len("socket:[") : -1]) for link in links.values() if link.startswith("socket:[")}
        named = {}  # inode -> the name another process could connect to ("@..." is an abstract address)
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[6]) in sockets and len(fields) > 7:
                named[int(fields[6])] = fields[7]
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        shared = {line.split(None, 5)[5] for line in maps if len(line.split(None, 5)) == 6 and "/memfd:" in line}
        assert sockets and named == {}  # its one channel to the rank, with no name
        assert shared and all(name.startswith("/memfd:") for name in shared)  # the snapshot buffers
        assert set(os.listdir("/dev/shm")) == shm_before
        assert os.stat(f"/proc/{pid}").st_uid == os.getuid()
    finally:
        ck.writer.close()


def _alive(pid: int) -> bool:
    """A process that runs (a zombie of an unrelated parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.invariant(2)
def test_snapshot_is_taken_at_the_save_step_and_buffers_are_reused(tmp_path):
    model, opt = make_state()
    expected = checkpointer_for(tmp_path / "sync" / "ckpt", 0, 2, async_save=False)
    torch.manual_seed(5)
    expected.save(1, model, opt, {"global_step": 1})
    ck = checkpointer_for(tmp_path / "async" / "ckpt", 0, 2, async_save=True)
    torch.manual_seed(5)
    ck.save(1, model, opt, {"global_step": 1})
    # Training goes on at once, while the write may still be in flight: the snapshot must not see it.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    pointers = {k: buf.data_ptr() for k, (_, buf) in ck.snapshots._buffers.items()}
    assert set(pointers) == {"model", "opt"} and ck.snapshots.allocations == 2
    ck.save(2, model, opt, {"global_step": 2})  # waits for save 1, then snapshots into the same buffers
    ck.close()
    assert files_of(tmp_path / "async" / "ckpt", 1) == files_of(tmp_path / "sync" / "ckpt", 1)
    assert files_of(tmp_path / "async" / "ckpt", 2) != files_of(tmp_path / "async" / "ckpt", 1)
    assert {k: buf.data_ptr() for k, (_, buf) in ck.snapshots._buffers.items()} == pointers
    assert ck.snapshots.allocations == 2  # nothing grown or reallocated by the second save
    assert [step for step, _ in ck.stalls] == [1, 2]


def test_a_failed_background_write_surfaces_at_the_next_save(tmp_path, monkeypatch):
    model, opt = make_state()
    ck = checkpointer_for(tmp_path / "ckpt", 0, 1, async_save=True)
    real = checkpointer_module.write_shards
    gate = threading.Event()

    def broken(*args, **kwargs):
        gate.wait(5)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer_module, "write_shards", broken)
    ck.save(1, model, opt, {"global_step": 1})  # returns at once: the write is in the thread
    gate.set()
    with pytest.raises(AsyncSaveError, match="iteration 1 failed.*No space left") as info:
        ck.save(2, model, opt, {"global_step": 2})
    assert isinstance(info.value.__cause__, OSError)
    # Raised once: the loop may go on, and a later save works again.
    monkeypatch.setattr(checkpointer_module, "write_shards", real)
    ck.save(2, model, opt, {"global_step": 2})
    ck.close()
    assert len(files_of(tmp_path / "ckpt", 2)) == 2


def test_a_failed_last_write_surfaces_at_the_final_wait(tmp_path, monkeypatch):
    model, opt = make_state()
    ck = checkpointer_for(tmp_path / "ckpt", 0, 1, async_save=True)
    monkeypatch.setattr(checkpointer_module, "write_shards", lambda *a, **k: 1 / 0)
    ck.save(1, model, opt, {"global_step": 1})
    with pytest.raises(AsyncSaveError, match="iteration 1") as info:
        ck.close()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert ck.close() == 0.0  # nothing left in flight


def test_a_failure_is_raised_even_at_a_step_that_does_not_save(tmp_path, monkeypatch):
    model, opt = make_state()
    ck = checkpointer_for(tmp_path / "ckpt", 0, 1, async_save=True, save_interleaved_steps=4)
    monkeypatch.setattr(checkpointer_module, "write_shards", lambda *a, **k: 1 / 0)
    ck.save(4, model, opt, {"global_step": 4})
    ck.background._pending[1].exception()  # let the thread fail
    with pytest.raises(AsyncSaveError):
        ck.poll()  # what RankCheckpointer.maybe_save does at every step, saving or not
