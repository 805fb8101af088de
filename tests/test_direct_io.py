"""Shard files written past the page cache (checkpoint/io/direct_io.py): the very bytes and digests of a
write through it, from the snapshot's own pages, none left in the page cache; and where a file system
refuses O_DIRECT (ramfs, mounted in a namespace of the test's own), the same files through the page
cache, said once per process, and the crash-while-saving cases still resuming exactly."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
import xxhash

from conftest import REPO, shard_bytes
from ray_resume.checkpoint.io import direct_io
from ray_resume.checkpoint.format import state
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.format.digest import block_bounds, hexdigest
from ray_resume.checkpoint.io.shard_file import ShardFile, write_file
from ray_resume.checkpoint.io.writer import HASHED_PIECE, SnapshotBuffers, live_data, shard_layouts
from ray_resume.model import GPT
from ray_resume.optim import MainParamsOptimizer
from test_async_save import MODES, FakeCoordinator, checkpointer_for

ALIGN = direct_io.ALIGN


class Hash:
    def __init__(self):
        self.h = xxhash.xxh3_64()

    def update(self, chunk):
        self.h.update(chunk)


def test_a_direct_write_is_the_bytes_and_the_digest_of_its_chunks_however_they_lie(tmp_path):
    """Headers of any length, data at any address (aligned as the file is or not), in pieces of any
    size, from read-only memory too (the writer process maps its buffers so)."""
    rng = random.Random(1)
    for trial in range(200):
        n = rng.choice([0, 1, 4095, 4096, 4097, 10_000, 1 << 20, (1 << 20) + 123, 3 << 20])
        head = rng.randbytes(rng.choice([0, 8, 104, 4096, 5000]))
        memory = mmap.mmap(-1, n + 2 * ALIGN)
        base = rng.choice([0, 8, 4000, (-len(head)) % ALIGN, rng.randrange(2 * ALIGN)])
        data = rng.randbytes(n)
        memory[base : base + n] = data
        view = memoryview(memory)[base : base + n]
        if trial % 2:  # read-only, as the writer process's mapping is
            view = view.toreadonly()
        piece = rng.choice([777, ALIGN, 1 << 20, max(n, 1)])
        chunks = [memoryview(head), *(view[i : i + piece] for i in range(0, n, piece))]
        digest = Hash()
        size = direct_io.write(str(tmp_path / "file"), chunks, digest)
        assert size == len(head) + n, trial
        assert (tmp_path / "file").read_bytes() == head + data, trial
        assert digest.h.digest() == xxhash.xxh3_64(head + data).digest(), trial
        del view, chunks
        memory.close()


def test_a_snapshot_lies_where_the_disk_takes_it_from_its_own_pages_hashed_as_it_was_copied(tmp_path):
    """However long the header (the opt shard's holds the RNG state, whose length changes), the data
    section is placed aligned as it is in the file: only the header and the last block are copied.
    The digests taken with the copy (in pieces of HASHED_PIECE, cut anywhere in a block; a tensor not
    contiguous too) are those of the file's bytes hashed afresh; sha256 (hashed on threads) and no
    checksum leave them to the writer."""
    model = GPT(vocab_size=256, seq_len=8, d_model=64, n_layers=2, n_heads=2)
    tensors = {
        **state.model_tensors(model),
        "big": torch.randn(HASHED_PIECE // 4 * 3 + 5),  # three pieces and a bit
        "half": torch.randn(HASHED_PIECE // 2 + 3).to(torch.bfloat16),
        "empty": torch.zeros(0),
        "transposed": torch.randn(300, 70).t(),  # not contiguous
    }
    states = {"model": tensors, "opt": None}
    for shared in (False, True):
        buffers = SnapshotBuffers(shared=shared)
        [shard] = shard_layouts(states, 0, 1)
        for head_bytes in (88, 4096, 4104, 5000, 12_344):  # safetensors pads a header to 8 bytes
            head = random.Random(head_bytes).randbytes(head_bytes)
            bounds = block_bounds(head_bytes + shard.nbytes, head_bytes, 100_000)
            file = ShardFile(str(tmp_path / "file"), "model", head, [hi for _, hi in bounds])
            hashed, [view] = buffers.take(shard, tensors, file, "xxh3-128")
            assert view.nbytes == shard.nbytes > 16 * ALIGN
            assert direct_io.address(view) % ALIGN == head_bytes % ALIGN
            fd = os.open(file.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
            writer = direct_io._Writer(fd, file.path)
            writer.write_all([memoryview(head), view], Hash())
            os.close(fd)
            assert writer.bounced < head_bytes + 2 * ALIGN, (shared, head_bytes, writer.bounced)
            on_disk = (tmp_path / "file").read_bytes()
            assert on_disk[head_bytes:] == b"".join(live_data_bytes(shard, tensors))
            assert list(hashed.digests) == [hexdigest("xxh3-128", on_disk[lo:hi]) for lo, hi in bounds]
            for unhashed in ("sha256", None):
                assert buffers.take(shard, tensors, file, unhashed)[0].digests is None
        # Written as a save writes it (16 MiB pieces, nothing hashed): the same bytes, the digests it
        # came with; a stream of another length than its blocks fails at the write, not at a load.
        hashed, [view] = buffers.take(shard, tensors, file, "xxh3-128")
        assert write_file(LocalStorage(), hashed, [view], "xxh3-128") == (len(on_disk), list(hashed.digests))
        assert (tmp_path / "file").read_bytes() == on_disk
        with pytest.raises(ValueError, match="the stream ended at byte"):
            write_file(LocalStorage(), hashed, [view[:-1]], "xxh3-128")


def live_data_bytes(shard, tensors) -> list[bytes]:
    return [bytes(v) for v in live_data(shard, tensors)]


def _resident_pages(path: Path) -> int:
    """How many of `path`'s pages are in the page cache (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        at = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(at, size, vec) == 0, ctypes.get_errno()
        libc.munmap(at, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def test_a_shard_written_past_the_page_cache_leaves_none_of_it_there(tmp_path):
    """Written by LocalStorage as a save writes a shard: none of its 8 MiB is in the page cache after
    (the same bytes written through it leave them there, which is what this can tell apart)."""
    data = memoryview(mmap.mmap(-1, 8 << 20))
    data[:] = random.Random(2).randbytes(data.nbytes)
    LocalStorage().write_durable(str(tmp_path / "direct"), [memoryview(b"head"), data], Hash())
    (tmp_path / "buffered").write_bytes(b"head" + bytes(data))
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    os.posix_fadvise(os.open(tmp_path / "direct", os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)  # what reading it cached
    assert _resident_pages(tmp_path / "direct") == 0
    assert _resident_pages(tmp_path / "buffered") > 0


def save_three_ways(root: Path) -> dict:
    """Rank 0 and 1 of a 2-rank save of step 3, saved sync, by the writer thread and by a writer
    process, each into root/MODE; the manifests reported (as JSON)."""
    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=8, d_model=64, n_layers=2, n_heads=2)
    opt = MainParamsOptimizer(model, lr=1e-2, weight_decay=0.0)
    opt.backward(model(torch.randint(0, 256, (2, 8))).float().sum())
    opt.step()
    reports, held = {}, []
    for mode, settings in MODES.items():
        for rank in range(2):
            coordinator = FakeCoordinator()
            ck = checkpointer_for(root / mode / "ckpt", rank, 2, coordinator=coordinator, **settings)
            held.append(ck)
            torch.manual_seed(1234)  # the same RNG states in every opt shard's header, in either process
            numpy.random.seed(1234)
            random.seed(1234)
            ck.save(3, model, opt, {"global_step": 3})
            ck.close()
            [(_, _, manifest, _)] = coordinator.reports
            reports[f"{mode}-{rank}"] = repr(manifest)
    for ck in held:
        if ck.writer:
            ck.writer.close()
    return reports


def in_a_ramfs(tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    """`command` in a user and mount namespace of its own with a ramfs (which refuses O_DIRECT) at
    tmp_path/ram; skipped where this machine gives no namespace."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no user namespace here to mount a ramfs in")
    ram = tmp_path / "ram"
    ram.mkdir()
    script = f'mount -t ramfs none {ram} && exec "$@"'
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )


@pytest.mark.invariant(2)
def test_where_o_direct_is_refused_the_same_files_are_written_through_the_page_cache(tmp_path):
    """The same saves (sync, writer thread, writer process) on ext4 (O_DIRECT) and on a ramfs (refused
    at open): the very files and manifests; the ramfs's refusal said once by each process that wrote
    there (the ranks' one, and each writer process), not once a file."""
    here = save_three_ways(tmp_path / "ext4")
    copy_out = (
        "import json, shutil, sys, test_direct_io as t; from pathlib import Path; "
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "ram, out = Path(sys.argv[1]), Path(sys.argv[2]); reports = t.save_three_ways(ram); "
        "shutil.copytree(ram, out); print(json.dumps(reports))"
    )
    done = in_a_ramfs(tmp_path, sys.executable, "-c", copy_out, str(tmp_path / "ram"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == here
    for mode in MODES:
        ours, theirs = (
            shard_bytes(tmp_path / "ext4" / mode / "ckpt", 3),
            shard_bytes(tmp_path / "out" / mode / "ckpt", 3),
        )
        assert len(ours) == 4 and ours == theirs, mode
    said = [line for line in done.stderr.splitlines() if "takes no O_DIRECT" in line]
    assert len(said) == 3, done.stderr[-3000:]  # this process, and the writer process of rank 0 and of rank 1


@pytest.mark.invariant(1, 2, 8)
def test_where_o_direct_is_refused_a_crash_while_saving_still_resumes_exactly(tmp_path):
    """tests/test_harness.py's crash-while-saving cases (a rank and its writer process killed half way
    through a file, its writer thread, a kill before the report), with every file on a ramfs."""
    test = "tests/test_harness.py::test_crash_while_saving_never_loads_the_half_written_iteration"
    done = in_a_ramfs(
        tmp_path,
        *(sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider", test),
        f"--basetemp={tmp_path / 'ram' / 'basetemp'}",
        f"--rootdir={REPO}",
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "3 passed" in done.stdout
    assert "takes no O_DIRECT" in done.stdout + done.stderr


def test_a_write_error_surfaces_as_the_os_error_it_is(tmp_path):
    """A file-size limit (RLIMIT_FSIZE) makes a write fail for real, half way through the file: the
    caller gets that OSError with its errno (what `retried` and the error messages go by), whether the
    refused write came from the bounce buffer or from the data's own pages."""
    data = memoryview(mmap.mmap(-1, 3 << 20))
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not the signal that would end us
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
        for head, start in ((b"h" * 104, ALIGN - 104), (b"h" * 100, 0)):  # data aligned as the file, or not
            with pytest.raises(OSError) as raised:
                direct_io.write(str(tmp_path / "big"), [memoryview(head), data[start:]], Hash())
            assert raised.value.errno == errno.EFBIG, raised.value
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_write_cut_short_leaves_what_came_before_it_on_disk(tmp_path):
    """What a crash half way through a shard leaves (the mid_shard_write fault, a storage error between
    two pieces): the pieces before it are in the file, to the last whole block, not held back in the
    bounce buffer; a half-written file is what the crash tests must then never load."""
    data = memoryview(mmap.mmap(-1, 3 << 20))
    data[:] = random.Random(3).randbytes(data.nbytes)
    head = b"h" * 104

    def cut_half_way():
        yield memoryview(head)
        for start in range(0, data.nbytes // 2, 100_000):  # unaligned pieces: all through the bounce buffer
            yield data[start : min(start + 100_000, data.nbytes // 2)]
        raise OSError(errno.EIO, "the storage went away")

    with pytest.raises(OSError):
        direct_io.write(str(tmp_path / "cut"), cut_half_way(), Hash())
    written = (tmp_path / "cut").read_bytes()
    assert len(head) + data.nbytes // 2 - ALIGN < len(written) <= len(head) + data.nbytes // 2
    assert written == (head + bytes(data))[: len(written)]
