"""What torch's `dcp.load` reads of a ray_resume root (`ray_resume.checkpoint.interop.dcp.Reader`), against what it
reads of its own checkpoint of the same state.

    python -m benchmarks.dcp_reads --out benchmarks/dcp_reads_results.json    # ~1 min on 2 cores

A 2-rank FSDP2 job (gloo) holds a GPT with AdamW state and saves it twice: through our writer and
commit, and with `dcp.save`. Then `dcp.load` fills a model and optimizer on 1 rank (plain), on 2
and 3 ranks (FSDP2) and on 2 ranks (DDP) from ours, and on 3 FSDP2 ranks from DCP's own; each
rank's bytes read are counted (ours: every checksum block read, to check it; DCP's: the stored
items it reads). The figure: bytes read by all ranks / the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from ray_resume import parallel
from ray_resume.checkpoint.format import paths, state
from ray_resume.checkpoint.commit import commit_iteration
from ray_resume.checkpoint.interop.dcp import Reader
from ray_resume.checkpoint.interop.dcp_checkpoint import DcpReader
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import save_shards
from ray_resume.model import GPT, lm_loss

SIZES = {
    "small": dict(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2),
    "60m": dict(vocab_size=8192, seq_len=64, d_model=512, n_layers=4, n_heads=8),
}
LOADS = [("ours", "plain", 1), ("ours", "fsdp", 2), ("ours", "fsdp", 3), ("ours", "ddp", 2), ("dcp", "fsdp", 3)]


def _build(rank: int, world: int, init: str, strategy: str, dims: dict):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(**dims)
    if strategy != "plain":
        model = parallel.wrap(model, strategy, [], torch.device("cpu"), world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad()
    lm_loss(model, torch.randint(0, dims["vocab_size"], (4, dims["seq_len"] + 1))).backward()
    optimizer.step()
    return model, optimizer


def _save(rank: int, world: int, init: str, out: str, dims: dict) -> None:
    model, optimizer = _build(rank, world, init, "fsdp", dims)
    manifest = save_shards(
        LocalStorage(),
        f"{out}/ours",
        1,
        prefix="ckpt",
        rank=rank,
        world_size=world,
        model_state=state.model_tensors(model),
        rank_extras=state.capture_rng(),
        optim_state=state.optim_tensors(list(state.unwrap(model).named_parameters()), optimizer),
    )
    manifests = [None] * world
    dist.all_gather_object(manifests, manifest)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
    if rank == 0:
        common = {
            "global_step": 1,
            "global_batch_size": 4,
            "step_num": 1,
            "epoch_num": 0,
            "loss_scale": 1.0,
            "consumed_samples": 4,
        }
        commit_iteration(
            LocalStorage(), f"{out}/ours", 1, manifests, common, prefix="ckpt", config={"name": "bench"}, job_id="bench"
        )
    dist.barrier()
    os._exit(0)


def _load(rank: int, world: int, init: str, out: str, dims: dict, source: str, strategy: str) -> None:
    model, optimizer = _build(rank, world, init, strategy, dims)
    msd, osd = get_state_dict(model, optimizer)
    reader = Reader(f"{out}/ours") if source == "ours" else DcpReader(f"{out}/dcp")
    dcp.load({"model": msd, "optim": {"state": osd["state"]}}, storage_reader=reader)
    reads = [None] * world
    dist.all_gather_object(reads, reader.bytes_read)
    if rank == 0:
        Path(out, f"{source}-{strategy}-{world}.json").write_text(json.dumps(reads))
    dist.barrier()
    os._exit(0)


def _spawn(fn, world: int, *args) -> None:
    init = f"file://{tempfile.gettempdir()}/dcp-reads-{uuid.uuid4().hex}"
    torch.multiprocessing.start_processes(fn, args=(world, init, *args), nprocs=world, join=True, start_method="spawn")


def run(size: str, out: str) -> dict:
    dims = SIZES[size]
    _spawn(_save, 2, out, dims)
    sizes = {
        "ours": sum(
            p.stat().st_size
            for p in Path(paths.iteration_dir(f"{out}/ours", 1)).iterdir()
            if paths.parse_shard_filename(p.name)
        ),
        "dcp": sum(p.stat().st_size for p in Path(out, "dcp").iterdir() if p.suffix == ".distcp"),
    }
    rows = []
    for source, strategy, world in LOADS:
        _spawn(_load, world, out, dims, source, strategy)
        reads = json.loads(Path(out, f"{source}-{strategy}-{world}.json").read_text())
        rows.append(
            {
                "checkpoint": source,
                "loaded as": f"{strategy}, {world} rank{'s' * (world > 1)}",
                "bytes read": reads,
                "ratio": round(sum(reads) / sizes[source], 3),
            }
        )
    return {"size": size, "checkpoint_bytes": sizes, "saved_by": "fsdp, 2 ranks", "loads": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="60m")
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args.size, tmp)
    for row in results["loads"]:
        print(
            f"{row['checkpoint']:>4} loaded as {row['loaded as']:<16} read {sum(row['bytes read']):>11} of "
            f"{results['checkpoint_bytes'][row['checkpoint']]} bytes: {row['ratio']:.2f}x"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
