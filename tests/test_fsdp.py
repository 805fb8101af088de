"""FSDP2 (`fully_shard`) checkpoints over real gloo process groups, no Ray.

Each case spawns W processes that build the same small GPT, wrap it for the
strategy, take two optimizer steps, and save or load through the real
writer and `Checkpointer.restore`. The consolidated states (DTensors
gathered with `full_tensor()`) are compared bit for bit with what the saving
side held: a checkpoint saved under ddp or fsdp on W ranks loads under the
other strategy, on W' ranks, to the same model and optimizer state.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import harness
from conftest import commit_by_hand, gathered_manifests, tiny_config
from ray_resume import parallel
from ray_resume.checkpoint.format import paths, state
from ray_resume.checkpoint.checkpointer import Checkpointer
from ray_resume.checkpoint.root import CommittedIteration
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.config import Config
from ray_resume.model import GPT, lm_loss
from ray_resume.optim import MainParamsOptimizer

STEP = 2


def _setup(rank: int, world: int, init: str, strategy: str, dtype: str):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # d_model 12 and 3 heads: dim 0 of most tensors (12, 36, 48) is not a multiple of 5 or 8,
    # so FSDP's torch.chunk gives uneven shards, and the vocab (13 rows) leaves trailing ranks short.
    model = GPT(vocab_size=13, seq_len=6, d_model=12, n_layers=2, n_heads=3).to(getattr(torch, dtype))
    model = parallel.wrap(model, strategy, [], torch.device("cpu"), world)
    optimizer = MainParamsOptimizer(model, lr=0.05, weight_decay=0.01)
    return model, optimizer


def _train(model, optimizer, steps: int, rank: int, world: int) -> list[float]:
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        batch = torch.randint(0, 13, (12, 7), generator=gen)  # the global batch (12 = 1, 2 or 3 equal slices)
        optimizer.zero_grad()
        loss = lm_loss(model, batch.chunk(world)[rank])
        optimizer.backward(loss)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _consolidated(model, optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, whole (FSDP shards all-gathered)."""

    def full(t):
        return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t

    out = {f"model/{n}": full(t).detach().clone() for n, t in state.model_tensors(model).items()}
    out |= {f"opt/{n}": full(t).detach().clone() for n, t in optimizer.state_tensors().items()}
    return out


def _save(rank: int, world: int, init: str, out: str, strategy: str, dtype: str) -> None:
    model, optimizer = _setup(rank, world, init, strategy, dtype)
    _train(model, optimizer, STEP, rank, world)
    root = str(Path(out, "ckpt"))
    manifests = gathered_manifests(root, STEP, state.model_tensors(model), optimizer.state_tensors(), rank, world)
    held = _consolidated(model, optimizer)
    next_loss = _train(model, optimizer, 1, rank, world)[0]  # the step a load of this checkpoint takes next
    if rank == 0:  # the driver's part of a commit
        commit_by_hand(root, STEP, manifests, global_batch_size=16, consumed_samples=16 * STEP)
        save_file(held, str(Path(out, "held.safetensors")))
        Path(out, "saved.json").write_text(json.dumps({"loss": next_loss}))
    _exit()


def _load(rank: int, world: int, init: str, out: str, strategy: str, dtype: str, label: str) -> None:
    model, optimizer = _setup(rank, world, init, strategy, dtype)
    _train(model, optimizer, 1, rank, world)  # optimizer state exists, and differs from the saved one
    cfg = Config.from_dict(tiny_config(Path(out), training={"strategy": strategy}, model={"dtype": dtype}))
    point, _ = Checkpointer(cfg.checkpoint, None, rank, world, 0, None).restore(
        model, optimizer, CommittedIteration(str(Path(out, "ckpt")), STEP), full=True
    )
    loaded = _consolidated(model, optimizer)
    losses = _train(model, optimizer, 1, rank, world)  # training continues from the loaded state
    if rank == 0:
        save_file(loaded, str(Path(out, f"{label}.safetensors")))
    reads = [None] * world
    dist.all_gather_object(reads, point.bytes_read)
    if rank == 0:
        Path(out, f"{label}.json").write_text(json.dumps({"bytes_read": reads, "loss": losses[0], "step": point.step}))
    _exit()


def _exit() -> None:
    """Leave without tearing down the process group under the live DDP/FSDP objects.

    Freeing a DDP reducer after its group is gone sometimes hangs the child at exit here.
    """
    dist.barrier()
    os._exit(0)


def spawn(fn, world: int, tmp: Path, *args) -> None:
    init = f"file://{tmp / f'pg-{uuid.uuid4().hex}'}"  # a fresh rendezvous file per group
    harness.spawn(fn, (world, init, str(tmp), *args), world)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "saved_as, dtype, loads",
    [
        ("fsdp", "float32", [("ddp", 3), ("ddp", 1), ("fsdp", 2), ("fsdp", 3)]),
        ("ddp", "bfloat16", [("fsdp", 3)]),
    ],
)
def test_save_under_one_strategy_load_under_the_other_on_any_world_size(tmp_path, saved_as, dtype, loads):
    spawn(_save, 2, tmp_path, saved_as, dtype)
    held = load_file(str(tmp_path / "held.safetensors"))
    storage = LocalStorage()
    it = open_iteration(storage, str(tmp_path / "ckpt"), STEP)
    on_disk = {f"{kind}/{n}": t for kind in ("model", "opt") for n, t in load_state(storage, it, kind).items()}
    assert_same(on_disk, held)  # what the ranks held is what the files say
    # FSDP: every tensor in the rows each rank held (the 0-d steps whole, on one rank); DDP on 2 ranks:
    # these tensors are small (under 64 KiB), so each is whole in one rank's file.
    chunks = {name: [p.numel for _, p in t.pieces] for kind in it.tensors.values() for name, t in kind.items()}
    if saved_as == "fsdp":
        assert all(len(c) == 2 for name, c in chunks.items() if not name.startswith("step."))
    assert all(len(c) == 1 for name, c in chunks.items() if saved_as == "ddp" or name.startswith("step."))

    results = {}
    for strategy, world in loads:
        label = f"{strategy}-{world}"
        spawn(_load, world, tmp_path, strategy, dtype, label)
        assert_same(load_file(str(tmp_path / f"{label}.safetensors")), held)
        results[label] = json.loads((tmp_path / f"{label}.json").read_text())
        assert results[label]["step"] == STEP
    # The first step after the load sees the same weights and the same global batch on every layout as
    # the saving one did. Not bit-equal: FSDP reduce-scatters and DDP all-reduces, summing in different orders.
    assert len(results) == len(loads)
    losses = [json.loads((tmp_path / "saved.json").read_text())["loss"]] + [r["loss"] for r in results.values()]
    assert max(losses) - min(losses) < 1e-5 * max(abs(v) for v in losses), losses
    if "fsdp-2" in results:
        assert_reads_own_share(tmp_path, results["fsdp-2"]["bytes_read"])


def assert_reads_own_share(tmp: Path, reads: list[int]) -> None:
    """FSDP on the saving world size: each rank reads exactly its own files, whole (digest-checked).
    The 0-d Adam steps split over both files reach the other rank through one all-reduce."""
    files = sorted(Path(paths.iteration_dir(str(tmp / "ckpt"), STEP)).glob("*.safetensors"))
    own = [
        sum(p.stat().st_size for p in files if paths.parse_shard_filename(p.name)["rank"] == rank) for rank in range(2)
    ]
    assert reads == own
