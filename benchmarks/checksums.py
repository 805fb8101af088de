"""Checksum speed: sha256, BLAKE3, xxh3-128 and CRC32C over the same 4 MiB blocks, in one run.

    python -m benchmarks.checksums              # 256 MiB of random bytes, best of 3 (seconds)
    python -m benchmarks.checksums --mib 1024 --threads 1 2 4

BLAKE3 and CRC32C are not dependencies of ray_resume: `pip install -e .[bench]`
brings them (a missing one is reported and skipped). Each algorithm hashes
every block of one buffer, on one thread and then with the blocks dealt over
a thread pool (all four release the GIL on large buffers), and the figure is
GB/s, the best of `--repeats`, with the ratio to sha256 (format 3's choice).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BLOCK = 4 << 20  # writer.CHECKSUM_BLOCK


def _algorithms() -> dict:
    """name -> function hashing one block; None where the package is missing."""
    found = {"sha256": lambda b: hashlib.sha256(b).digest()}
    for name, module, make in [
        ("blake3", "blake3", lambda m: lambda b: m.blake3(b).digest()),
        ("xxh3-128", "xxhash", lambda m: lambda b: m.xxh3_128(b).digest()),
        ("crc32c", "crc32c", lambda m: m.crc32c),
    ]:  # SSE4.2 / ARMv8 CRC instructions
        try:
            found[name] = make(importlib.import_module(module))
        except ImportError:
            found[name] = None
    return found


def measure(mib: int, threads: list[int], repeats: int) -> dict:
    buf = memoryview(os.urandom(mib << 20))
    blocks = [buf[i : i + BLOCK] for i in range(0, len(buf), BLOCK)]
    results: dict = {"bytes": len(buf), "block": BLOCK, "cpus": os.cpu_count(), "gbps": {}}
    for name, fn in _algorithms().items():
        if fn is None:
            results["gbps"][name] = None
            continue
        results["gbps"][name] = {}
        for n in threads:
            best = float("inf")
            with ThreadPoolExecutor(n) as pool:
                for _ in range(repeats):
                    start = time.perf_counter()
                    if n == 1:
                        for b in blocks:
                            fn(b)
                    else:
                        list(pool.map(fn, blocks))
                    best = min(best, time.perf_counter() - start)
            results["gbps"][name][n] = len(buf) / best / 1e9
    return results


def table(results: dict) -> str:
    threads = sorted({n for v in results["gbps"].values() if v for n in v})
    base = results["gbps"]["sha256"]
    rows = [
        "| checksum | " + " | ".join(f"{n} thread{'s' * (n > 1)}, GB/s (vs sha256)" for n in threads) + " |",
        "|---|" + "---|" * len(threads),
    ]
    for name, by in results["gbps"].items():
        cells = (
            [f"{by[n]:.2f} ({by[n] / base[n]:.1f}x)" for n in threads]
            if by
            else ["not installed (pip install -e .[bench])"] * len(threads)
        )
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of random bytes hashed per round")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)
    results = measure(args.mib, args.threads, args.repeats)
    print(f"{results['bytes'] >> 20} MiB in {BLOCK >> 20} MiB blocks, {results['cpus']} CPUs, best of {args.repeats}")
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
