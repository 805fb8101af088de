"""What the data stream reads: bytes read per consumed byte and samples/s per rank at 1, 2 and 4
ranks, with data lanes (`data.lanes`) and without (one lane: every rank reads every row group of
every global batch and keeps its slice), from local disk and from a moto S3 server on loopback,
and the plan's cost at 1,024 to 16,384 ranks.

    python -m benchmarks.data [--out benchmarks/data_results.json]

Every rank's stream is the real `SampleStream` reading through Ray Data (a local Ray); the ranks
of one world size run one after another on this machine, each timed on its own. "read/consumed"
is what all ranks read from storage (the compressed column chunks of the row groups they read)
over what the samples they consumed weigh; 1.00 is every sample read once.
"row groups in a global batch" (at 1 rank) is how many row groups a batch mixes: the shuffle's
quality within a batch (a full permutation of the 2,560 samples mixes 25.4 of the 64 in a batch of 32).
The plan rows time `plan_lane` for one rank's lanes over a dataset of row-group sizes only (no
files): what a rank computes at each epoch, and how many row groups it opens per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ray_resume.data import ReadUnit, SampleStream, dataset_size, plan_lane, quiet_ray_data, scan_units, write_synthetic

GBS, STEPS = 32, 120  # 3840 samples: an epoch and a half of the dataset below
SAMPLES, SEQ_LEN, FILES, GROUPS_PER_FILE = 2560, 256, 4, 16  # 64 row groups of 40 rows, 1 KiB a sample


def stream_run(units, lanes: int, rank: int, world: int, storage) -> tuple[int, float, float]:
    """Bytes read, samples/s, and the mean number of row groups a batch of this rank mixes."""
    stream = SampleStream(units, 1, True, GBS, rank, world, 0, lanes=lanes, storage=storage, read_tasks_above=0)
    batches = iter(stream)
    first = [next(batches)]  # the pipeline's start is not a rate
    started = time.perf_counter()
    rest = list(itertools.islice(batches, STEPS - 1))
    rate = (STEPS - 1) * stream.local_batch_size / (time.perf_counter() - started)
    starts = np.cumsum([u.num_rows for u in units])  # sample ids are in file order: id -> its row group
    mixed = np.mean([len(np.unique(np.searchsorted(starts, b["sample_id"], side="right"))) for b in first + rest])
    return stream.bytes_read, rate, float(mixed)


def streams(units, where: str, storage=None) -> list[dict]:
    per_sample = sum(u.nbytes for u in units) / dataset_size(units)
    consumed = STEPS * GBS * per_sample
    rows = []
    for lanes in (1, 8):
        for world in (1, 2, 4):
            runs = [stream_run(units, lanes, r, world, storage) for r in range(world)]
            rows.append(
                {
                    "storage": where,
                    "lanes": lanes,
                    "world": world,
                    "read_over_consumed": sum(r[0] for r in runs) / consumed,
                    "samples_per_s_per_rank": float(np.mean([r[1] for r in runs])),
                    "row_groups_per_global_batch": runs[0][2] if world == 1 else None,
                }
            )
            mixed = f" | {runs[0][2]:.1f} row groups in a global batch" if world == 1 else ""
            print(
                f"{where:>5} | lanes {lanes:>2} | {world} ranks | read/consumed {rows[-1]['read_over_consumed']:.2f} | "
                f"{rows[-1]['samples_per_s_per_rank']:.0f} samples/s per rank{mixed}",
                flush=True,
            )
    return rows


def on_moto(local: Path):
    """A moto S3 server on loopback holding a copy of the dataset: (its s3:// path, checkpoint.storage options, server)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import s3_server

    from ray_resume.checkpoint.io.object_store import s3_filesystem

    server, options = s3_server.start("data", key="bench")
    fs = s3_filesystem(options)
    for f in sorted(local.glob("*.parquet")):
        with fs.open_output_stream(f"data/bench/{f.name}") as out:
            out.write(f.read_bytes())
    return "s3://data/bench", options, server


def plans() -> list[dict]:
    """A 1B-sample corpus in row groups of 10,000 (100,000 of them), one lane per rank."""
    rng = np.random.default_rng(0)
    units = [
        ReadUnit(f"part-{i // 100:05d}.parquet", i % 100, int(n))
        for i, n in enumerate(rng.integers(9_000, 11_000, 100_000))
    ]
    rows = []
    for world in (1024, 4096, 16384):
        gbs = 4 * world
        started = time.perf_counter()
        plan = plan_lane(units, 1, 0, True, world, world // 2)  # the middle rank's lane: half the order scanned
        plan_s = time.perf_counter() - started
        steps_per_epoch = dataset_size(units) // gbs
        rows.append(
            {
                "world": world,
                "plan_s_per_rank_epoch": plan_s,
                "row_groups_per_rank_per_step": len(plan) / steps_per_epoch,
            }
        )
        print(
            f"{world:>5} ranks | plan {plan_s * 1000:.0f} ms per rank per epoch | "
            f"{rows[-1]['row_groups_per_rank_per_step']:.4f} row groups opened per rank per step",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/data_results.json")
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    quiet_ray_data()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data"
        write_synthetic(path, SAMPLES, SEQ_LEN, 1000, seed=0, files=FILES, row_groups_per_file=GROUPS_PER_FILE)
        remote, options, server = on_moto(path)
        try:
            rows = streams(scan_units(path), "local") + streams(scan_units(remote, storage=options), "moto", options)
        finally:
            server.stop()
        results = {"streams": rows, "plans": plans()}
    ray.shutdown()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
