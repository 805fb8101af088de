"""The CPU one rank's async save costs, part by part: the copy into its snapshot buffers, hashed as
it is copied (as a save takes it), then the write of its shard files past the page cache (O_DIRECT,
as a save writes them now) and through it (as a file system without O_DIRECT gets them), by turns
in the same run; beside them the copy alone, with no hash, which the save's CPU is measured against.

    python -m benchmarks.save_cpu --size 50m --rounds 5   # the README's figures (~1 min)
    python -m benchmarks.save_cpu --size tiny --rounds 1  # seconds (CI: tests/test_benchmark.py)

One process, no Ray: rank 0's share of a 2-rank save of the built-in GPT with its AdamW state, on
an otherwise idle machine. "CPU" is this thread's (time.thread_time); "node CPU" is every CPU's
busy time over the write and its fsync (/proc/stat), which also holds the kernel's writeback of a
page cache, on no process's account. Each figure is the median of the rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.checkpoint import SEQ_LEN, SIZES, report
from ray_resume.checkpoint.io import direct_io
from ray_resume.checkpoint.format import state
from ray_resume.checkpoint.io.shard_file import write_file
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import SnapshotBuffers, shard_files, shard_layouts
from ray_resume.model import GPT
from ray_resume.optim import MainParamsOptimizer

WAYS = ("past the page cache", "through the page cache")


def node_busy_s() -> float:
    """Every CPU's busy seconds so far: all but idle and I/O wait (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(size: str, rounds: int, base: str) -> dict:
    torch.set_num_threads(1)
    vocab, d_model, layers, heads = SIZES[size]
    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, seq_len=SEQ_LEN, d_model=d_model, n_layers=layers, n_heads=heads)
    optimizer = MainParamsOptimizer(model, lr=1e-4, weight_decay=0.0)
    optimizer.backward(model(torch.randint(0, vocab, (2, SEQ_LEN))).float().sum())
    optimizer.step()
    optimizer.zero_grad()
    states = {"model": state.model_tensors(model), "opt": optimizer.state_tensors()}
    shards = shard_layouts(states, 0, 2)
    root = tempfile.mkdtemp(prefix="save-cpu-", dir=base)
    files = shard_files(root, 1, shards, prefix="ckpt", rank=0, world_size=2, rank_extras={"rng": "{}"})
    os.makedirs(os.path.dirname(files[0].path))
    buffers = SnapshotBuffers(shared=True)  # as the writer process's
    direct = direct_io.write
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    try:
        for i in range(rounds):
            for way in WAYS[i % 2 :] + WAYS[: i % 2]:
                cpu = time.thread_time()
                for s, f in zip(shards, files):
                    buffers.take(s, states[s.kind], f, None)
                copy = time.thread_time() - cpu
                cpu = time.thread_time()
                taken = [buffers.take(s, states[s.kind], f, "xxh3-128") for s, f in zip(shards, files)]
                copy_hash = time.thread_time() - cpu
                direct_io.write = direct if way == WAYS[0] else (lambda *args: None)  # None: refused at open
                cpu, node, wall = time.thread_time(), node_busy_s(), time.perf_counter()
                for f, data in taken:
                    write_file(LocalStorage(), f, data, "xxh3-128")
                runs[way].append(
                    {
                        "copy_cpu_s": copy,
                        "copy_hash_cpu_s": copy_hash,
                        "write_cpu_s": time.thread_time() - cpu,
                        "write_node_cpu_s": node_busy_s() - node,
                        "write_wall_s": time.perf_counter() - wall,
                    }
                )
                for f in files:
                    os.unlink(f.path)
    finally:
        direct_io.write = direct
        shutil.rmtree(root, ignore_errors=True)
    out = {"share_bytes": sum(s.nbytes for s in shards), "ways": {}}
    for way, samples in runs.items():
        out["ways"][way] = {key: round(statistics.median(s[key] for s in samples), 4) for key in samples[0]}
    return out


def table(results: dict) -> str:
    r = results["result"]
    lines = [
        f"One rank's async save of {results['size']} ({r['share_bytes'] / 1e6:.0f} MB), median of "
        f"{results['rounds']} rounds:",
        "| the write | copy alone CPU | copy + hash CPU | write CPU | write, node CPU | write wall "
        "| save CPU / copy alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for way, w in r["ways"].items():
        save = w["copy_hash_cpu_s"] + w["write_cpu_s"]
        lines.append(
            f"| {way} | {w['copy_cpu_s']:.3f} s | {w['copy_hash_cpu_s']:.3f} s | {w['write_cpu_s']:.3f} s | "
            f"{w['write_node_cpu_s']:.3f} s | {w['write_wall_s']:.3f} s | {save / w['copy_cpu_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="50m", choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/save_cpu_results.json")
    ap.add_argument("--dir", default=None, help="where the files are written (default: a temp dir)")
    args = ap.parse_args(argv)
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    results = {
        "command": "python -m benchmarks.save_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "size": args.size,
        "rounds": args.rounds,
        "result": measure(args.size, args.rounds, base),
    }
    report(results, table(results), args.out, "save_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
