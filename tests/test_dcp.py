"""PyTorch's own checkpoint API reads our roots: torch's `dcp.load` with `ray_resume.checkpoint.dcp.Reader`.

A 2-rank FSDP2 job (gloo) trains with torch's AdamW and saves through our writer and the driver's
commit; it keeps, beside the root, every tensor it held at the saved step, whole. Then torch's own
`dcp.load` and `set_state_dict` fill a freshly built model and optimizer on 1 rank (plain modules)
and on 3 ranks (FSDP2, uneven shards), which are compared element by element with what the job
held: not with what our own loader reads.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import harness
from conftest import commit_by_hand
from ray_resume import parallel
from ray_resume.checkpoint import paths, state
from ray_resume.checkpoint.dcp import Reader
from ray_resume.checkpoint.storage import LocalStorage
from ray_resume.checkpoint.writer import save_shards
from ray_resume.model import GPT, lm_loss

STEP = 2


def _build(rank: int, world: int, init: str, strategy: str, seed: int):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    # Rows of 13, 12, 36 and 48: FSDP2 shards them unevenly on 3 ranks, and leaves trailing ranks short.
    model = GPT(vocab_size=13, seq_len=6, d_model=12, n_layers=2, n_heads=3)
    if strategy == "fsdp":
        model = parallel.wrap(model, strategy, [], torch.device("cpu"), world)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _train(model, optimizer, steps: int, rank: int, world: int) -> None:
    for step in range(steps):
        batch = torch.randint(0, 13, (12, 7), generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        lm_loss(model, batch.chunk(world)[rank]).backward()
        optimizer.step()


def _whole(model, optimizer) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors under DCP's flattened names, whole (DTensors gathered)."""
    msd, osd = get_state_dict(model, optimizer)
    full = {f"model.{k}": v for k, v in msd.items()}
    full |= {f"optim.state.{p}.{slot}": v for p, slots in osd["state"].items() for slot, v in slots.items()}
    return {k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v).detach().clone() for k, v in full.items()}


def _save(rank: int, world: int, init: str, out: str) -> None:
    model, optimizer = _build(rank, world, init, "fsdp", seed=0)
    _train(model, optimizer, STEP, rank, world)
    root = str(Path(out, "ckpt"))
    named = list(state.unwrap(model).named_parameters())
    manifest = save_shards(LocalStorage(), root, STEP, prefix="ckpt", rank=rank, world_size=world,
                           model_state=state.model_tensors(model), optim_state=state.optim_tensors(named, optimizer),
                           rank_extras=state.capture_rng())
    manifests = [None] * world
    dist.all_gather_object(manifests, manifest)
    held = _whole(model, optimizer)
    if rank == 0:
        commit_by_hand(root, STEP, manifests)
        save_file(held, str(Path(out, "held.safetensors")))
    dist.barrier()
    os._exit(0)


def _load(rank: int, world: int, init: str, out: str, strategy: str, label: str) -> None:
    model, optimizer = _build(rank, world, init, strategy, seed=1)  # other weights than the saved ones
    _train(model, optimizer, 1, rank, world)  # and optimizer state to overwrite
    msd, osd = get_state_dict(model, optimizer)
    reader = Reader(Path(out, "ckpt"))
    dcp.load({"model": msd, "optim": {"state": osd["state"]}}, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    loaded = _whole(model, optimizer)
    reads = [None] * world
    dist.all_gather_object(reads, reader.bytes_read)
    if rank == 0:
        save_file(loaded, str(Path(out, f"{label}.safetensors")))
        Path(out, f"{label}.json").write_text(json.dumps({"bytes_read": reads}))
    dist.barrier()
    os._exit(0)


def _load_failing(rank: int, world: int, init: str, out: str, step: int | None) -> None:
    model, optimizer = _build(rank, world, init, "plain", seed=1)
    msd, _ = get_state_dict(model, optimizer)
    try:
        dcp.load({"model": msd}, storage_reader=Reader(Path(out, "ckpt"), step=step))
        Path(out, "error.txt").write_text("")
    except BaseException as exc:  # DCP wraps what a rank raised in its CheckpointException, a BaseException
        Path(out, "error.txt").write_text(str(exc))
    os._exit(0)


def spawn(fn, world: int, tmp: Path, *args) -> None:
    harness.spawn(fn, (world, f"file://{tmp / f'pg-{uuid.uuid4().hex}'}", str(tmp), *args), world)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dcp")
    spawn(_save, 2, tmp)
    return tmp


@pytest.mark.parametrize("strategy, world", [("plain", 1), ("fsdp", 3)])
def test_torch_dcp_load_reads_our_root_on_another_world_size(saved, strategy, world):
    label = f"{strategy}{world}"
    spawn(_load, world, saved, strategy, label)
    held, loaded = load_file(str(saved / "held.safetensors")), load_file(str(saved / f"{label}.safetensors"))
    assert held.keys() == loaded.keys() and any(k.endswith(".exp_avg_sq") for k in held) and any(k.endswith(".step") for k in held)
    for name in held:
        assert held[name].dtype == loaded[name].dtype and torch.equal(held[name], loaded[name]), name
    size = sum(p.stat().st_size for p in Path(paths.iteration_dir(str(saved / "ckpt"), STEP)).iterdir()
               if paths.parse_shard_filename(p.name))
    reads = json.loads((saved / f"{label}.json").read_text())["bytes_read"]
    assert all(n > 0 for n in reads) and sum(reads) >= size  # every byte of the root, some read by more than one rank
    print(f"{label}: DCP's load read {sum(reads)} bytes of a {size}-byte iteration ({sum(reads) / size:.2f}x), per rank {reads}")


def test_a_damaged_block_fails_dcps_load_naming_the_file(saved, tmp_path):
    damaged = tmp_path / "ckpt"
    import shutil

    shutil.copytree(saved / "ckpt", damaged)
    shard = Path(paths.iteration_dir(str(damaged), STEP)) / "ckpt-model-0000001-0000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    spawn(_load_failing, 1, tmp_path, None)
    error = (tmp_path / "error.txt").read_text()
    assert f"{shard}: xxh3-128 does not match metadata.json (checksum block" in error and "the shard is corrupt" in error, error


def test_an_iteration_that_is_not_committed_is_refused(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    shutil.copytree(paths.iteration_dir(str(tmp_path / "ckpt"), STEP), paths.iteration_dir(str(tmp_path / "ckpt"), STEP + 1))
    spawn(_load_failing, 1, tmp_path, STEP + 1)
    error = (tmp_path / "error.txt").read_text()
    assert f"iteration {STEP + 1} is not committed (the tracker names {STEP})" in error, error


def test_dcps_own_whole_checkpoint_load_takes_every_tensor_without_a_process_group(saved):
    """`format_utils.dcp_to_torch_save`'s call with our reader in place of its FileSystemReader: an
    empty state dict that DCP's planner fills from the metadata alone, in one process."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    everything: dict = {}
    _load_state_dict(everything, storage_reader=Reader(saved / "ckpt"), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    held = load_file(str(saved / "held.safetensors"))
    assert held.keys() <= everything.keys()
    for name in held:
        assert torch.equal(held[name], everything[name]), name
