"""Training throughput while checkpointing: every contender in the same rounds, relative to no saves.

    python -m benchmarks.throughput --sizes 50m --rounds 2 --cycles 2   # the README's table (~24 min)
    python -m benchmarks.throughput --sizes tiny --rounds 1 --cycles 1   # seconds (CI: tests/test_benchmark.py)

Setup as `benchmarks.checkpoint`'s: 2 Ray actors (one CPU each) joined by gloo, a real GPT
under DistributedDataParallel with AdamW. Each run trains `cycles + 2` save intervals and
saves every `k` steps; the rate is taken over whole save cycles in steady state: from the
end of the second save's step (buffers allocated, writer processes started by then) to the
end of the last save's step (its stall included). So each contender is charged exactly
`cycles` saves; none gets its last write for free or pays a one-time start in the window.
The slowest rank's window counts. Beside the rate, the CPU seconds one of our saves costs a rank,
a figure the VM's drift in speed moves far less: the training thread's CPU in the save call (the
copy, for an async save; the whole write, for a sync one) and its writer thread's or writer
process's over the window (/proc), per save, the median of the ranks (the kernel's writeback of
a page cache, on no one's account, is not in it). A round runs every contender once, in an order rotated
each round, each beside a run without saves of the same length (before it in even rounds,
after it in odd ones): this VM's speed drifts by more than what is measured (runs without
saves moved from 1.07 to 1.58 steps/s within one benchmark), and a pair sees the same
drift. The figure is the median over rounds of the pair's ratio, with the spread (lowest
and highest).

`--baseline cycles` pairs at a finer grain, inside each run, so that minutes of drift cannot
decide: a contender saves every `2k` steps, and the `k` steps from each save (its stall, and its
write in the background) are timed against the next `k` steps, which have no save, about as
long and seconds later; nor a write in flight, checked: a pair whose write still ran when its
clean half began is marked `*` and counted (`spilled`). Each pair's ratio (clean / with the save) is the
throughput of a save every `k` steps against none; the figure is the median over every pair of
every round (the first save, which allocates and starts the writer, is not paired). No runs
without saves: the clean half-cycles are the baseline.

Contenders: ours sync; ours async with a writer thread; ours async with a writer
process (`checkpoint.async_writer`); ours with `checkpoint.async_save: auto` (its measuring saves
in the window: what a run of that length gets; what it chose is printed); DCP `save`; DCP `async_save` with its thread and with its
process executor (`AsyncCheckpointerType.PROCESS`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import ray
import torch

from benchmarks.checkpoint import (
    SEQ_LEN,
    SIZES,
    Rank,
    _all,
    _config,
    _controller,
    _free_port,
    _release,
    common_at,
    init_ray,
    report,
    teardown,
)

CONTENDERS = ["sync", "async_thread", "async_process", "auto", "dcp", "dcp_async_thread", "dcp_async_process"]
OURS = {
    "sync": {"async_save": False},
    "async_thread": {"async_save": True, "async_writer": "thread"},
    "async_process": {"async_save": True, "async_writer": "process"},
    "auto": {"async_save": "auto"},  # its first saves measure both ways, the 4th decides (checkpoint.async_choice)
}


class TrainingRank(Rank):
    def train(self, steps: int, every: int, mode: str, root: str, coordinator, halves: bool = False) -> dict:
        """`steps` DDP steps saving every `every`; returns the steady-state window (see the module doc).
        `halves` (--baseline cycles): `every` is 2k, and each save after the first is timed over the k steps
        from it against the k steps after those (`pairs`: seconds with the save, seconds clean)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.nn.parallel import DistributedDataParallel

        if not hasattr(self, "ddp"):
            self.ddp = DistributedDataParallel(self.model)
            # DCP's async thread runs collectives while the loop's DDP runs its own: a group of their own,
            # as DCP's docs ask (on the default group they deadlock)
            self.dcp_group = torch.distributed.new_group(backend="gloo")
        ck = self._checkpointer(root, coordinator, save_every=every, **OURS[mode]) if mode in OURS else None
        pending = None  # DCP's save in flight: waited for before the next one, as DCP's docs do
        gen = torch.Generator().manual_seed(100 + self.rank)
        vocab = SIZES[self.size][0]
        ends: dict[int, float] = {}
        stalls: list[float] = []
        spilled: dict[int, bool] = {}  # halves: save step -> its write still in flight when its clean half began
        first, last = 2 * every, steps - steps % every
        save_cpu, writer_cpu = 0.0, {}  # the training thread's CPU in the window's saves; the writer's at its ends
        self._barrier()
        for step in range(1, steps + 1):
            ids = torch.randint(0, vocab, (2, SEQ_LEN + 1), generator=gen)
            self.optimizer.zero_grad()
            self.optimizer.backward(self.lm_loss(self.ddp, ids))
            self.optimizer.step()
            if mode != "never" and step % every == 0:
                start, cpu = time.perf_counter(), time.thread_time()
                if ck:
                    ck.save(step, self.ddp, self.optimizer, common_at(step))
                else:
                    if pending is not None:
                        pending.result()
                    path = os.path.join(root, f"step-{step}")
                    if mode == "dcp":
                        dcp.save(self._state(), checkpoint_id=path)
                    else:
                        kind = (
                            AsyncCheckpointerType.PROCESS
                            if mode == "dcp_async_process"
                            else AsyncCheckpointerType.THREAD
                        )
                        pending = dcp.async_save(
                            self._state(),
                            checkpoint_id=path,
                            async_checkpointer_type=kind,
                            process_group=self.dcp_group,
                        )
                stalls.append(time.perf_counter() - start)
                if first < step <= last:
                    save_cpu += time.thread_time() - cpu
            ends[step] = time.perf_counter()
            if halves and step > every and step % every == every // 2 - 1:  # a clean half starts: is it?
                spilled[step + 1 - every // 2] = ck.background.in_flight if ck else bool(pending and not pending.done())
            if step in (first, last) and ck:
                writer_cpu[step] = writers_cpu_s(ck)
        if ck:
            ck.close()
        if pending is not None:
            pending.result()
        self.optimizer.zero_grad()
        self._barrier()
        half = every // 2
        return {
            "pairs": [
                (ends[s + half - 1] - ends[s - 1], ends[s + every - 1] - ends[s + half - 1], spilled[s])
                for s in range(2 * every, steps - every + 2, every)  # every save but the first, its clean half run
            ]
            if halves
            else None,
            "window_s": ends[last] - ends[first],
            "window_steps": last - first,
            "stalls": stalls,
            # the window's saves: the copies (or writes) of first+every..last, the background writes of first..last-every
            "save_cpu_s": (save_cpu + writer_cpu[last] - writer_cpu[first]) / ((last - first) // every) if ck else None,
            "chose": ck.choice.why if ck and ck.choice and ck.choice.decided is not None else None,
        }


def writers_cpu_s(ck) -> float:
    """CPU seconds so far of a checkpointer's writer process and of its rank's writer threads (/proc)."""
    tasks = [f"/proc/{ck.writer.pid}/stat"] if ck.writer is not None and ck.writer.pid else []
    tasks += [f"/proc/self/task/{t.native_id}/stat" for t in threading.enumerate() if t.name.startswith("ckpt-writer")]
    ticks = 0
    for task in tasks:
        with open(task) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


ThroughputWorker = ray.remote(num_cpus=1)(TrainingRank)


def bench_size(
    size: str, base: str, *, intervals: list[int], cycles: int, rounds: int, contenders: list[str], halves: bool = False
) -> dict:
    root = tempfile.mkdtemp(prefix=f"throughput-{size}-", dir=base)
    port = _free_port()
    workers = [ThroughputWorker.remote() for _ in range(2)]
    held = []
    try:
        setup = ray.get([w.setup.remote(r, 2, port, size, root, None) for r, w in enumerate(workers)])
        print(f"[throughput] {size}: {setup[0]['params'] / 1e6:.1f}M parameters, 2 workers, {root}", flush=True)
        runs = [(mode, k) for mode in contenders if mode != "never" for k in intervals]
        rates: dict[str, list[float]] = {}
        save_cpu: dict[str, list[float]] = {}  # CPU seconds a save of ours costs a rank (median of the ranks)
        stalls: dict[str, list[float]] = {}
        chose: dict[str, list[str]] = {}  # `auto`'s verdict in each run (rank 0's)
        spills: dict[str, int] = {}  # halves: pairs whose write ran into their clean half
        # (steps/s, steps/s of the run without saves beside it); halves: (clean s, s with the save)
        pairs: dict[str, list[tuple[float, float]]] = {}

        def run(mode: str, k: int, i: int) -> float:
            run_root = os.path.join(root, f"{mode}-{k}")
            coordinator = None
            every = 2 * k if halves else k
            if mode in OURS:
                held.append(_controller(ray_resume_config(run_root, size, every), f"throughput-{size}-{mode}-{k}"))
                coordinator = held[-1][0]
            res = _all(workers, "train", every * (cycles + 2), every, mode, run_root, coordinator, halves)
            if coordinator is not None:
                committed = ray.get(coordinator.last_committed.remote())
                if committed != every * (cycles + 2):  # never time saves that did not commit
                    raise RuntimeError(f"{mode} saves did not commit: last committed {committed}")
                _release(held.pop())
            shutil.rmtree(run_root, ignore_errors=True)
            key = "never" if mode == "never" else f"{mode}@{k}"
            rates.setdefault(key, []).append(res[0]["window_steps"] / max(x["window_s"] for x in res))
            if res[0]["save_cpu_s"] is not None:
                save_cpu.setdefault(key, []).append(statistics.median(x["save_cpu_s"] for x in res))
            stalls.setdefault(key, []).extend(max(s) for s in zip(*(x["stalls"] for x in res)) if s)
            cpu = f", {save_cpu[key][-1]:.3f} CPU s a save" if key in save_cpu else ""
            if res[0]["chose"]:
                chose.setdefault(key, []).append(res[0]["chose"])
                cpu += f", auto chose {res[0]['chose']}"
            if halves:  # the slowest rank's halves: the ranks step in lockstep, the slower one sets the pace
                in_run = [(max(w), max(c), any(s)) for w, c, s in (zip(*p) for p in zip(*(x["pairs"] for x in res)))]
                pairs.setdefault(key, []).extend((clean, with_save) for with_save, clean, _ in in_run)
                # a write still running when the clean half began makes that half not clean: counted, said
                spills[key] = spills.get(key, 0) + sum(s for _, _, s in in_run)
                cpu += ", clean/with a save: " + " ".join(f"{c / w:.3f}{'*' * s}" for w, c, s in in_run)
            print(f"[throughput] {size} round {i + 1}: {key} {rates[key][-1]:.3f} steps/s{cpu}", flush=True)
            return rates[key][-1]

        for i in range(rounds):
            for mode, k in runs[i % len(runs) :] + runs[: i % len(runs)]:
                if halves:  # its baseline is inside the run
                    run(mode, k, i)
                    continue
                # Each contender beside a run without saves, first or second by turns: this VM's speed
                # drifts by more than the differences measured, and a pair sees the same drift.
                if i % 2 == 0:
                    never = run("never", k, i)
                    rate = run(mode, k, i)
                else:
                    rate = run(mode, k, i)
                    never = run("never", k, i)
                pairs.setdefault(f"{mode}@{k}", []).append((rate, never))
        return summarize(setup[0]["params"], rates, pairs, stalls, save_cpu, chose, intervals, cycles, spills, halves)
    finally:
        teardown(workers, held, root)


def ray_resume_config(root: str, size: str, every: int):
    from ray_resume.config import Config

    return Config.from_dict(_config(root, size, save_every=every))


def summarize(
    params: int,
    rates: dict[str, list[float]],
    pairs: dict[str, list[tuple[float, float]]],
    stalls: dict[str, list[float]],
    save_cpu: dict[str, list[float]],
    chose: dict[str, list[str]],
    intervals,
    cycles,
    spills: dict[str, int],
    halves: bool = False,
) -> dict:
    """Per contender and interval: steps/s (median), and its ratio to the run without saves beside it
    (median, spread); with `halves`, to the clean half-cycle beside each save (`pairs`: clean s, with s)."""
    out: dict = {
        "params": params,
        "intervals": intervals,
        "cycles": cycles,
        "baseline": "cycles" if halves else "runs",
        "never_steps_per_s": None if halves else round(statistics.median(rates["never"]), 4),
        "contenders": {},
    }
    for key, runs in pairs.items():
        values = [rate / never for rate, never in runs]  # halves: clean seconds / seconds with the save
        out["contenders"][key] = {
            "steps_per_s": round(statistics.median(rates[key]), 4),
            **(
                {"pairs": [[round(clean, 4), round(with_save, 4)] for clean, with_save in runs], "spilled": spills[key]}
                if halves
                else {}
            ),
            "beside_never_steps_per_s": None if halves else round(statistics.median(never for _, never in runs), 4),
            "vs_never": round(statistics.median(values), 4),
            "vs_never_spread": [round(min(values), 4), round(max(values), 4)],
            "stall_s": round(statistics.median(stalls[key]), 4) if stalls.get(key) else None,
            "save_cpu_s": round(statistics.median(save_cpu[key]), 4) if key in save_cpu else None,
            "save_cpu_spread": [round(min(save_cpu[key]), 4), round(max(save_cpu[key]), 4)]
            if key in save_cpu
            else None,
            **({"auto_chose": chose[key]} if key in chose else {}),
        }
    return out


def table(results: dict) -> str:
    lines = []
    for size, r in results["sizes"].items():
        ks = r["intervals"]
        if r["baseline"] == "cycles":
            lines.append(
                f"Training throughput, {size} ({r['params'] / 1e6:.0f}M), relative to no saves: the k steps from "
                f"each save against the k clean steps after them, the median of every pair of "
                f"{results['rounds']} rounds [lowest, highest]:"
            )
        else:
            lines.append(
                f"Training throughput, {size} ({r['params'] / 1e6:.0f}M), relative to no saves "
                f"({r['never_steps_per_s']:.3f} steps/s); median of {results['rounds']} rounds [lowest, highest]:"
            )
        lines.append(
            "| contender |"
            + "".join(f" a save every {k} |" for k in ks)
            + "".join(f" stall @{k} |" for k in ks)
            + "".join(f" CPU a save @{k} |" for k in ks)
        )
        lines.append("|---|" + "---|" * 3 * len(ks))
        for mode in results["contenders"]:
            cells = [r["contenders"].get(f"{mode}@{k}") for k in ks]
            lines.append(
                f"| {mode} |"
                + "".join(
                    f" {c['vs_never']:.3f}x [{c['vs_never_spread'][0]:.3f}, {c['vs_never_spread'][1]:.3f}] |"
                    if c
                    else " - |"
                    for c in cells
                )
                + "".join(f" {c['stall_s']:.3f} s |" if c and c["stall_s"] is not None else " - |" for c in cells)
                + "".join(
                    f" {c['save_cpu_s']:.3f} s [{c['save_cpu_spread'][0]:.3f}, {c['save_cpu_spread'][1]:.3f}] |"
                    if c and c["save_cpu_s"] is not None
                    else " - |"
                    for c in cells
                )
            )
        for key, c in r["contenders"].items():
            if c.get("spilled"):
                lines.append(f"- {key}: in {c['spilled']} pairs its write ran into the clean half (not clean)")
            for why in c.get("auto_chose", []):
                lines.append(f"- {key}, `async_save: auto` chose {why}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50m,300m", help="comma list of " + ", ".join(SIZES))
    ap.add_argument("--intervals", default="5,10", help="save every k steps, comma list")
    ap.add_argument("--cycles", type=int, default=3, help="save cycles timed per run (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every contender (default 3)")
    ap.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="comma list (each runs beside a run without saves, or saves every 2k: --baseline)",
    )
    ap.add_argument(
        "--baseline",
        choices=("runs", "cycles"),
        default="runs",
        help="runs: each run beside one without saves; cycles: each save's steps beside the clean steps after them",
    )
    ap.add_argument("--out", default="benchmarks/throughput_results.json")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = ap.parse_args(argv)
    sizes, contenders = args.sizes.split(","), args.contenders.split(",")
    intervals = sorted(int(k) for k in args.intervals.split(","))
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    if not set(contenders) <= set(CONTENDERS):
        ap.error(f"contenders: any of {', '.join(CONTENDERS)}")
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    started = init_ray()
    results = {
        "command": "python -m benchmarks.throughput " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__},
        "workers": 2,
        "rounds": args.rounds,
        "contenders": contenders,
        "sizes": {},
    }
    try:
        for size in sizes:
            results["sizes"][size] = bench_size(
                size,
                base,
                intervals=intervals,
                cycles=args.cycles,
                rounds=args.rounds,
                contenders=contenders,
                halves=args.baseline == "cycles",
            )
    finally:
        if started:
            ray.shutdown()
    report(results, table(results), args.out, "throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
