"""Checkpoint benchmark: our save/load against a raw write, torch DCP and torch.save, in one run.

    python -m benchmarks.checkpoint                 # ~50M and ~300M parameter GPTs (minutes)
    python -m benchmarks.checkpoint --small         # a tiny GPT, seconds (CI: tests/test_benchmark.py)
    python -m benchmarks.checkpoint --sizes 50m --out benchmarks/results.json

Setup: 2 plain Ray actors (one CPU each) joined by a gloo process group on
loopback, each holding the same real `ray_resume.model.GPT` and AdamW state
(one optimizer step taken, so exp_avg/exp_avg_sq exist), writing to a local
temp dir. Our saves go through the real `Checkpointer.maybe_save` and a real
driver-side `JobController` (so a save is timed up to its commit);
our loads through the real `Checkpointer.restore` (loader.StateLoader, which
streams shard bytes into the rank's tensors), with and without load_balanced. Every number is the
slowest rank's, measured after a barrier, and the median over `--repeats` rounds in which every
contender takes one turn, in an order rotated each round. Before each load the files are
dropped from the page cache (posix_fadvise DONTNEED), so loads read storage.
Bytes read are each rank's `read()` bytes (/proc/self/io rchar), summed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from benchmarks.page_cache import drop_cache

SIZES = {  # name: (vocab_size, d_model, n_layers, n_heads)
    "tiny": (256, 64, 2, 4),
    "50m": (16384, 512, 12, 8),
    "300m": (16384, 1024, 22, 16),
}
SEQ_LEN = 32

# Every row the JSON has for every size (tests/test_benchmark.py checks them all).
ROWS = [
    "params",
    "checkpoint_bytes",
    "ours_sync_save_s",
    "ours_sync_stall_s",
    "ours_sync_save_sha256_s",
    "ours_async_first_stall_s",
    "ours_async_stall_s",
    "ours_async_save_s",
    "raw_write_s",
    "ours_save_gbps",
    "raw_write_gbps",
    "ours_vs_raw",
    "ours_vs_raw_paired",
    "ours_sha256_vs_raw",
    "ours_load_s",
    "ours_load_bytes_read",
    "ours_load_sha256_s",
    "ours_load_balanced_s",
    "ours_load_balanced_bytes_read",
    "dcp_save_s",
    "dcp_async_stall_s",
    "dcp_async_save_s",
    "dcp_load_s",
    "dcp_load_bytes_read",
    "torch_save_s",
    "torch_load_s",
    "torch_load_bytes_read",
    "async_stall_vs_sync_save",
    "async_stall_vs_dcp_async_stall",
    "ours_save_vs_dcp_save",
    "ours_save_vs_torch_save",
    "ours_load_vs_dcp_load",
    "ours_load_sha256_vs_dcp_load",
    "ours_load_vs_torch_load",
    "load_bytes_read_vs_checkpoint",
    "load_balanced_bytes_read_vs_checkpoint",
]


def _config(root: str, size: str, *, save_every: int = 1, **checkpoint) -> dict:
    """The benchmark's job config; `checkpoint` keys (async_save, load_balanced, checksum...) override."""
    vocab, d, layers, heads = SIZES[size]
    return {
        "name": f"bench-{size}",
        "model": {
            "vocab_size": vocab,
            "seq_len": SEQ_LEN,
            "d_model": d,
            "n_layers": layers,
            "n_heads": heads,
            "dtype": "float32",
            "dropout": 0.0,
        },
        "data": {"path": os.path.join(root, "unused-data")},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_steps": 10**9, "lr": 1e-4, "seed": 0},
        "scaling": {"num_workers": 2},
        "checkpoint": {
            "save_path": os.path.join(root, "ckpt"),
            "save_interleaved_steps": save_every,
            "save_max": 1000,
            "checksum": "xxh3-128",
            **checkpoint,
        },
    }


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def common_at(step: int) -> dict:
    """What a loop tells the checkpointer of `step` (a global batch of 4)."""
    return {
        "global_step": step,
        "global_batch_size": 4,
        "consumed_samples": 4 * step,
        "epoch_num": 0,
        "step_num": step,
        "loss_scale": 1.0,
    }


class Rank:
    """One rank: its model, optimizer and checkpointer; every method is a collective phase."""

    def setup(self, rank: int, world: int, port: int, size: str, root: str, coordinator) -> dict:
        import torch.distributed as dist

        from ray_resume.config import Config
        from ray_resume.model import build_model, lm_loss
        from ray_resume.optim import MainParamsOptimizer

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        self.rank, self.world, self.size, self.root, self.coordinator = rank, world, size, root, coordinator
        cfg = Config.from_dict(_config(root, size))
        torch.manual_seed(0)  # the same weights and the same step on every rank: replicated, as under DDP
        self.model = build_model(cfg.model)
        self.optimizer = MainParamsOptimizer(self.model, lr=1e-4, weight_decay=0.0)
        ids = torch.randint(0, cfg.model.vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
        self.optimizer.zero_grad()
        self.optimizer.backward(lm_loss(self.model, ids))
        self.optimizer.step()
        self.optimizer.zero_grad()  # grads freed: only weights + Adam state stay
        self.lm_loss = lm_loss
        return {"params": sum(p.numel() for p in self.model.parameters())}

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def _checkpointer(self, root: str, coordinator=None, **kw):
        from ray_resume.checkpoint.checkpointer import Checkpointer
        from ray_resume.config import Config
        from ray_resume.controller.client import ControllerClient
        from ray_resume.faults import FaultInjector

        cfg = Config.from_dict(_config(root, self.size, **kw))
        return Checkpointer(
            cfg.checkpoint,
            ControllerClient(coordinator or self.coordinator),
            self.rank,
            self.world,
            0,
            FaultInjector(None, self.rank, lambda: False),
        )

    def _state(self) -> dict:
        from ray_resume.checkpoint.format import state

        return {"model": state.model_tensors(self.model), "optim": self.optimizer.state_tensors()}

    # ------------------------------------------------------------------ ours
    def ours_save(self, step: int, async_save: bool, checksum: str = "xxh3-128") -> dict:
        """Save iteration `step`, timed to its commit; one Checkpointer per mode, so async snapshot buffers are reused."""
        cks = self.__dict__.setdefault("_checkpointers", {})
        ck = cks.get((async_save, checksum)) or cks.setdefault(
            (async_save, checksum), self._checkpointer(self.root, async_save=async_save, checksum=checksum)
        )
        self._barrier()
        start = time.perf_counter()
        ck.save(step, self.model, self.optimizer, common_at(step))
        stall = time.perf_counter() - start
        ck.close()
        total = time.perf_counter() - start
        return {
            "stall": stall,
            "total": total,
            "bytes": sum(info["size"] for _, info in self._my_files(ck.ckpt.save_path, step)),
        }

    def _my_files(self, root: str, step: int) -> list[tuple[str, dict]]:
        from ray_resume.checkpoint.format import paths

        d = paths.iteration_dir(root, step)
        out = []
        for n in sorted(os.listdir(d)):
            parsed = paths.parse_shard_filename(n)
            if parsed and parsed["rank"] == self.rank:
                out.append((os.path.join(d, n), {"size": os.path.getsize(os.path.join(d, n))}))
        return out

    def raw_write(self, step: int) -> dict:
        """This rank's shard files of `step`, written again as plain bytes + fsync: the storage's own speed."""
        files = self._my_files(os.path.join(self.root, "ckpt"), step)
        names = [os.path.basename(path) for path, _ in files]
        blobs = [Path(path).read_bytes() for path, _ in files]
        out = os.path.join(self.root, "raw", str(self.rank))
        os.makedirs(out, exist_ok=True)
        self._barrier()
        start = time.perf_counter()
        for name, blob in zip(names, blobs):
            with open(os.path.join(out, name), "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        elapsed = time.perf_counter() - start
        del blobs
        self.cleanup("raw")
        return {"total": elapsed, "bytes": sum(info["size"] for _, info in files)}

    def ours_load(self, step: int, balanced: bool) -> dict:
        ck = self._checkpointer(self.root, load_balanced=balanced)
        drop_cache(self.root)
        gc.collect()
        self._barrier()
        before, start = _rchar(), time.perf_counter()
        from ray_resume.checkpoint.root import CommittedIteration

        point, _ = ck.restore(self.model, self.optimizer, CommittedIteration(ck.ckpt.save_path, step), full=True)
        elapsed = time.perf_counter() - start
        read = _rchar() - before
        gc.collect()
        self._barrier()
        return {"total": elapsed, "bytes_read": point.bytes_read, "rchar": read}

    # ------------------------------------------------------------------ torch.distributed.checkpoint
    def dcp_save(self, mode: str) -> dict:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.root, f"dcp-{mode}")
        self.cleanup(f"dcp-{mode}")  # every save writes new files, as ours do
        state = self._state()
        self._barrier()
        start = time.perf_counter()
        if mode == "sync":
            dcp.save(state, checkpoint_id=path)
            stall = time.perf_counter() - start
        else:
            future = dcp.async_save(state, checkpoint_id=path)
            stall = time.perf_counter() - start
            (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        total = time.perf_counter() - start
        del state
        gc.collect()
        self._barrier()
        return {"stall": stall, "total": total}

    def dcp_load(self) -> dict:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.root, "dcp-sync")
        drop_cache(path)
        state = self._state()  # DCP loads in place into these tensors
        self._barrier()
        before, start = _rchar(), time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        elapsed = time.perf_counter() - start
        read = _rchar() - before
        del state
        self._barrier()
        return {"total": elapsed, "bytes_read": read}

    # ------------------------------------------------------------------ torch.save on rank 0
    def torch_save(self) -> dict:
        path = os.path.join(self.root, "torch", "state.pt")
        self.cleanup("torch")
        start = time.perf_counter()
        if self.rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                torch.save(self._state(), f)
                f.flush()
                os.fsync(f.fileno())
        self._barrier()  # the other ranks wait for it: the whole group is stalled
        return {"total": time.perf_counter() - start}

    def torch_load(self) -> dict:
        from ray_resume.checkpoint.format import state as st

        path = os.path.join(self.root, "torch", "state.pt")
        drop_cache(os.path.dirname(path))
        self._barrier()
        before, start = _rchar(), time.perf_counter()
        loaded = torch.load(path, weights_only=True)  # every rank needs the whole state under DDP
        st.unwrap(self.model).load_state_dict(loaded["model"])
        self.optimizer.load_state_tensors(loaded["optim"])
        elapsed = time.perf_counter() - start
        read = _rchar() - before
        del loaded
        gc.collect()
        self._barrier()
        return {"total": elapsed, "bytes_read": read}

    def cleanup(self, name: str, keep: int | None = None) -> None:
        """Remove what a phase wrote (our iterations but `keep`); a checkpoint root itself stays (its lease is there)."""
        self._barrier()
        if self.rank == 0:
            path = os.path.join(self.root, name)
            if name == "ckpt":
                for entry in os.listdir(path):
                    if entry.startswith("iteration_") and entry != f"iteration_{keep or 0:08d}":
                        shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
            else:
                shutil.rmtree(path, ignore_errors=True)
            # The deletes' journal and discards are flushed here, not inside the next timed write
            # (every contender's write starts on a settled disk, the raw write's included).
            os.sync()
        self._barrier()


BenchWorker = ray.remote(num_cpus=1)(Rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all(workers, method: str, *args) -> list[dict]:
    return ray.get([getattr(w, method).remote(*args) for w in workers])


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def _fits(nbytes: float) -> bool:
    """True when `nbytes` more fit in 85% of this machine's available memory."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return nbytes <= 0.85 * avail


def _controller(cfg, job_id: str):
    """The job's controller for `cfg`'s save_path, with the writer lease its commits check (as `run` takes it)."""
    from ray_resume.checkpoint.root import root_for
    from ray_resume.ray_backend import JobControllerActor

    os.makedirs(cfg.checkpoint.save_path)
    lease = root_for(cfg.checkpoint.save_path).lease(job_id, cfg.checkpoint.lease_ttl_s)
    lease.acquire()
    lease.keep_renewed()
    controller = JobControllerActor.remote(cfg.checkpoint.save_path, job_id, cfg, os.getpid())
    ray.get(controller.start_attempt.remote(cfg.scaling.max_workers))  # attempt 0
    return controller, lease


def _release(coordinator) -> None:
    controller, lease = coordinator
    ray.get(controller.release.remote())
    ray.kill(controller)
    lease.release()


def _median_of_max(runs: list[list[dict]], key: str) -> float:
    """Median over runs of the slowest rank's `key` (each run: one dict per rank)."""
    return statistics.median(max(x[key] for x in run) for run in runs)


def _rounds(repeats: int, phases: dict) -> None:
    """Run every phase once per round; each round starts one phase later than the previous one."""
    order = list(phases)
    for i in range(repeats):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            phases[name]()


def bench_size(size: str, base: str, *, repeats: int = 1, pairs: int = 10) -> dict:
    from ray_resume.config import Config

    root = tempfile.mkdtemp(prefix=f"ckpt-bench-{size}-", dir=base)
    cfg = Config.from_dict(_config(root, size))
    coordinators = [_controller(cfg, f"bench-{size}")]
    coordinator = coordinators[0][0]
    port = _free_port()
    workers = [BenchWorker.remote() for _ in range(2)]
    try:
        params = ray.get([w.setup.remote(r, 2, port, size, root, coordinator) for r, w in enumerate(workers)])[0][
            "params"
        ]
        print(f"[bench] {size}: {params / 1e6:.1f}M parameters, 2 workers, {root}", flush=True)
        r: dict = {"params": params}

        # Each number is the median over `repeats` rounds of the slowest rank. The contenders take
        # turns within a round, in an order rotated each round: this VM's disk and page
        # allocation speed drift by up to 4x within minutes, and all of them must see the same drift.
        step = 1
        first = _all(workers, "ours_save", step, True)  # allocates the async snapshot buffers
        r["checkpoint_bytes"] = sum(x["bytes"] for x in first)
        r["ours_async_first_stall_s"] = max(x["stall"] for x in first)
        saves: dict[str, list] = {k: [] for k in ("sync", "sync_sha256", "async", "raw", "dcp", "dcp_async", "torch")}

        def ours(mode: str) -> None:
            nonlocal step
            _all(workers, "cleanup", "ckpt", step)  # only the newest iteration stays (raw_write rewrites it)
            step += 1
            saves[mode].append(
                _all(workers, "ours_save", step, mode == "async", "sha256" if mode == "sync_sha256" else "xxh3-128")
            )

        _rounds(
            repeats,
            {
                "sync": lambda: ours("sync"),
                "sync_sha256": lambda: ours("sync_sha256"),  # format 3's checksum, as an option now
                "async": lambda: ours("async"),
                "raw": lambda: saves["raw"].append(_all(workers, "raw_write", step)),
                "dcp": lambda: saves["dcp"].append(_all(workers, "dcp_save", "sync")),
                "dcp_async": lambda: saves["dcp_async"].append(_all(workers, "dcp_save", "async")),
                "torch": lambda: saves["torch"].append(_all(workers, "torch_save")),
            },
        )
        # Sync save against the raw write of the same bytes as alternating pairs: each pair sees the
        # same disk, so its ratio cancels the drift that separate phases' medians do not.
        pair_ratios = []
        for _ in range(pairs):
            _all(workers, "cleanup", "ckpt", step)
            step += 1
            ours_s = max(x["total"] for x in _all(workers, "ours_save", step, False, "xxh3-128"))
            raw_s = max(x["total"] for x in _all(workers, "raw_write", step))
            pair_ratios.append(raw_s / ours_s)
        r["ours_vs_raw_paired"] = round(statistics.median(pair_ratios), 4)
        r["ours_vs_raw_pairs"] = [round(x, 4) for x in pair_ratios]
        # The iterations the loads read: one with each checksum.
        _all(workers, "cleanup", "ckpt", step)
        _all(workers, "ours_save", step + 1, False, "xxh3-128")
        _all(workers, "ours_save", step + 2, False, "sha256")
        step += 2
        committed = ray.get(coordinator.last_committed.remote())
        if committed != step:  # never time saves that did not commit
            raise RuntimeError(
                f"benchmark saves did not commit: last committed iteration is {committed}, expected {step}"
            )
        r["ours_sync_save_s"] = _median_of_max(saves["sync"], "total")
        r["ours_sync_stall_s"] = _median_of_max(saves["sync"], "stall")
        r["ours_sync_save_sha256_s"] = _median_of_max(saves["sync_sha256"], "total")
        r["ours_async_stall_s"] = _median_of_max(saves["async"], "stall")
        r["ours_async_save_s"] = _median_of_max(saves["async"], "total")
        r["raw_write_s"] = _median_of_max(saves["raw"], "total")
        gb = r["checkpoint_bytes"] / 1e9
        r["ours_save_gbps"] = round(gb / r["ours_sync_save_s"], 4)
        r["raw_write_gbps"] = round(gb / r["raw_write_s"], 4)
        r["ours_vs_raw"] = _ratio(r["ours_save_gbps"], r["raw_write_gbps"])
        r["ours_sha256_vs_raw"] = _ratio(r["raw_write_s"], r["ours_sync_save_sha256_s"])
        r["dcp_save_s"] = _median_of_max(saves["dcp"], "total")
        r["dcp_async_stall_s"] = _median_of_max(saves["dcp_async"], "stall")
        r["dcp_async_save_s"] = _median_of_max(saves["dcp_async"], "total")
        r["torch_save_s"] = _median_of_max(saves["torch"], "total")
        _all(workers, "cleanup", "dcp-async")
        print(f"[bench] {size}: saves done", flush=True)

        # Our loader and torch.load build fresh tensors of the whole state (~1.1x the checkpoint
        # per rank on top of the live state, until they are copied in): skip what cannot fit.
        loads: dict[str, list] = {
            "ours_load": [],
            "ours_load_sha256": [],
            "ours_load_balanced": [],
            "dcp_load": [],
            "torch_load": [],
        }
        phases = {"dcp_load": lambda: loads["dcp_load"].append(_all(workers, "dcp_load"))}
        skipped = r.setdefault("skipped", {})
        if _fits(2 * 1.1 * r["checkpoint_bytes"]):
            phases["ours_load"] = lambda: loads["ours_load"].append(_all(workers, "ours_load", step - 1, False))
            phases["ours_load_sha256"] = lambda: loads["ours_load_sha256"].append(
                _all(workers, "ours_load", step, False)
            )
            phases["ours_load_balanced"] = lambda: loads["ours_load_balanced"].append(
                _all(workers, "ours_load", step - 1, True)
            )
            phases["torch_load"] = lambda: loads["torch_load"].append(_all(workers, "torch_load"))
        else:
            for key in ("ours_load", "ours_load_sha256", "ours_load_balanced", "torch_load"):
                skipped[key] = f"needs ~{2 * 1.1 * r['checkpoint_bytes'] / 1e9:.0f} GB free beyond the live state"
        _rounds(repeats, phases)
        for key, runs in loads.items():
            if runs:
                r[f"{key}_s"] = _median_of_max(runs, "total")
                r[f"{key}_bytes_read"] = sum(x["bytes_read"] for x in runs[0])
        for name in ("ckpt", "dcp-sync", "torch"):
            _all(workers, "cleanup", name)
        print(f"[bench] {size}: loads done", flush=True)

        r["async_stall_vs_sync_save"] = _ratio(r["ours_async_stall_s"], r["ours_sync_save_s"])
        r["async_stall_vs_dcp_async_stall"] = _ratio(r["ours_async_stall_s"], r["dcp_async_stall_s"])
        r["ours_save_vs_dcp_save"] = _ratio(r["ours_sync_save_s"], r["dcp_save_s"])
        r["ours_save_vs_torch_save"] = _ratio(r["ours_sync_save_s"], r["torch_save_s"])
        r["ours_load_vs_dcp_load"] = _ratio(r.get("ours_load_s"), r.get("dcp_load_s"))
        r["ours_load_sha256_vs_dcp_load"] = _ratio(r.get("ours_load_sha256_s"), r.get("dcp_load_s"))
        r["ours_load_vs_torch_load"] = _ratio(r.get("ours_load_s"), r.get("torch_load_s"))
        r["load_bytes_read_vs_checkpoint"] = _ratio(r.get("ours_load_bytes_read"), r.get("checkpoint_bytes"))
        r["load_balanced_bytes_read_vs_checkpoint"] = _ratio(
            r.get("ours_load_balanced_bytes_read"), r.get("checkpoint_bytes")
        )

        return r
    finally:
        teardown(workers, coordinators, root)


def teardown(workers, coordinators, root: str) -> None:
    """End a size's actors and controllers (releasing their leases) and remove what it wrote."""
    for w in workers:
        ray.kill(w)
    for c in coordinators:
        _release(c)
    shutil.rmtree(root, ignore_errors=True)


def _fmt_s(v):
    return "-" if v is None else f"{v:.3f} s"


def _cell(fn, r: dict) -> str:
    try:
        return fn(r)
    except (KeyError, TypeError):  # a row skipped for memory (see "skipped" in the JSON)
        return "skipped"


def table(results: dict) -> str:
    sizes = list(results["sizes"])
    rows = [
        ("parameters", lambda r: f"{r['params'] / 1e6:.1f}M"),
        ("checkpoint size (model + Adam)", lambda r: f"{r['checkpoint_bytes'] / 1e9:.3f} GB"),
        ("ours sync: save to commit (= stall)", lambda r: _fmt_s(r["ours_sync_save_s"])),
        ("ours sync with sha256 (format 3's checksum)", lambda r: _fmt_s(r["ours_sync_save_sha256_s"])),
        ("ours async: stall (buffers reused)", lambda r: _fmt_s(r["ours_async_stall_s"])),
        ("ours async: stall, first save (allocates)", lambda r: _fmt_s(r["ours_async_first_stall_s"])),
        ("ours async: save to commit", lambda r: _fmt_s(r["ours_async_save_s"])),
        ("async stall / sync save", lambda r: f"{r['async_stall_vs_sync_save']:.3f}"),
        ("raw write + fsync, same bytes", lambda r: _fmt_s(r["raw_write_s"])),
        (
            "ours save GB/s  vs raw GB/s",
            lambda r: f"{r['ours_save_gbps']:.3f} vs {r['raw_write_gbps']:.3f} ({r['ours_vs_raw']:.2f}x)",
        ),
        (
            "ours vs raw, median of alternating pairs",
            lambda r: f"{r['ours_vs_raw_paired']:.2f}x ({len(r['ours_vs_raw_pairs'])} pairs)",
        ),
        ("ours with sha256 vs raw (speed ratio)", lambda r: f"{r['ours_sha256_vs_raw']:.2f}x"),
        (
            "DCP save / async_save stall / async total",
            lambda r: f"{r['dcp_save_s']:.3f} / {r['dcp_async_stall_s']:.3f} / {r['dcp_async_save_s']:.3f} s",
        ),
        ("torch.save on rank 0", lambda r: _fmt_s(r["torch_save_s"])),
        ("ours save / DCP save", lambda r: f"{r['ours_save_vs_dcp_save']:.2f}"),
        ("ours save / torch.save", lambda r: f"{r['ours_save_vs_torch_save']:.2f}"),
        ("ours async stall / DCP async stall", lambda r: f"{r['async_stall_vs_dcp_async_stall']:.2f}"),
        (
            "load, direct (bytes read / ckpt)",
            lambda r: f"{r['ours_load_s']:.3f} s ({r['load_bytes_read_vs_checkpoint']:.2f}x)",
        ),
        ("load, direct, sha256", lambda r: _fmt_s(r["ours_load_sha256_s"])),
        (
            "load, load_balanced (bytes read / ckpt)",
            lambda r: f"{r['ours_load_balanced_s']:.3f} s ({r['load_balanced_bytes_read_vs_checkpoint']:.2f}x)",
        ),
        (
            "DCP load (bytes read / ckpt)",
            lambda r: f"{r['dcp_load_s']:.3f} s ({r['dcp_load_bytes_read'] / r['checkpoint_bytes']:.2f}x)",
        ),
        (
            "torch.load weights_only, every rank",
            lambda r: f"{r['torch_load_s']:.3f} s ({r['torch_load_bytes_read'] / r['checkpoint_bytes']:.2f}x)",
        ),
        ("ours load / DCP load", lambda r: f"{r['ours_load_vs_dcp_load']:.2f}"),
        ("ours load with sha256 / DCP load", lambda r: f"{r['ours_load_sha256_vs_dcp_load']:.2f}"),
        ("ours load / torch.load", lambda r: f"{r['ours_load_vs_torch_load']:.2f}"),
    ]
    head = ["| |"] + [f" {s} |" for s in sizes]
    lines = ["".join(head), "|---|" + "---|" * len(sizes)]
    for label, fn in rows:
        lines.append(f"| {label} |" + "".join(f" {_cell(fn, results['sizes'][s])} |" for s in sizes))
    for s in sizes:
        for what, why in results["sizes"][s].get("skipped", {}).items():
            lines.append(f"{s}: {what} skipped on this machine ({why})")
    return "\n".join(lines)


def init_ray() -> bool:
    """A Ray of its own, or the cluster RAY_ADDRESS names (the test suite's); True when started here."""
    if ray.is_initialized():
        return False
    own = (
        {}
        if os.environ.get("RAY_ADDRESS")
        else {"num_cpus": 3, "object_store_memory": 200 * 1024**2, "include_dashboard": False}
    )
    ray.init(
        address=os.environ.get("RAY_ADDRESS", "local"),
        log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}},
        **own,
    )
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny model, seconds (CI)")
    ap.add_argument("--sizes", default=None, help="comma list of " + ", ".join(SIZES) + " (default 50m,300m)")
    ap.add_argument("--out", default="benchmarks/results.json")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs per save measurement, median reported (default 3, --small 1)"
    )
    ap.add_argument(
        "--pairs", type=int, default=None, help="alternating (sync save, raw write) pairs (default 10, --small 2)"
    )
    args = ap.parse_args(argv)
    sizes = (args.sizes or ("tiny" if args.small else "50m,300m")).split(",")
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    repeats = args.repeats or (1 if args.small else 3)
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    started = init_ray()
    results = {
        "command": "python -m benchmarks.checkpoint " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__},
        "workers": 2,
        "backend": "gloo (plain Ray actors)",
        "repeats": repeats,
        "sizes": {},
    }
    try:
        for size in sizes:
            results["sizes"][size] = bench_size(
                size, base, repeats=repeats, pairs=args.pairs or (2 if args.small else 10)
            )
    finally:
        if started:
            ray.shutdown()
    report(results, table(results), args.out, "bench")
    return 0


def report(results: dict, text: str, out: str | None, tag: str) -> None:
    """Print the table; write the JSON to `out` (when given)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"[{tag}] wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
