"""PyTorch's own checkpoint format both ways (`ray_resume.checkpoint.interop.dcp`).

A 2-rank FSDP2 job (gloo) trains with torch's AdamW and saves twice at the same step: through our
writer and the driver's commit, and with torch's own `dcp.save` in the layouts torchtitan has written
(`titan*/step-2/`: the model under "model" or at the top, the optimizer's flattened state under
"optimizer", `train_state` with its step and its pickled lists) and in DCP's docs' (`{"model", "optim"}`);
it keeps every tensor it held, whole, beside them. Then:
- torch's `dcp.load` and `set_state_dict` fill a freshly built model and optimizer from our root on
  1 rank (plain modules) and on 3 ranks (FSDP2, uneven shards), compared element by element with
  what the job held, not with what our own loader reads;
- our restore takes DCP's checkpoint on 1 and 2 (DDP) and 3 (FSDP2) ranks, weights alone or with
  Adam's state and torchtitan's `train_state.step`, equal to what the job held; a whole job with
  `load_path` at the torchtitan folder resumes at its step, and started from its weights alone
  writes the very bytes of one started from our own root of the same weights;
- `.metadata`, which torch pickles, is read by an unpickler of DCP's own classes alone.
"""

from __future__ import annotations

import io
import json
import os
import re
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import harness
from conftest import (
    commit_by_hand,
    driver_checks,
    gathered_manifests,
    read_metrics,
    run_on_harness,
    shard_bytes,
    tiny_config,
)
from ray_resume import parallel
from ray_resume.checkpoint.format import paths, state
from ray_resume.checkpoint.checkpointer import Checkpointer
from ray_resume.checkpoint.interop.dcp import Reader
from ray_resume.checkpoint.interop.dcp_checkpoint import DCP_METADATA, dcp_checkpoint, read_dcp_metadata
from ray_resume.checkpoint.root import DcpCheckpoint
from ray_resume.config import Config
from ray_resume.errors import CheckpointError
from ray_resume.model import GPT, lm_loss
from ray_resume.optim import MainParamsOptimizer
from ray_resume.preflight import resolve_source

STEP = 2


def _train_state() -> dict:
    """torchtitan's TrainState.state_dict(): its step, and its loss history as torch.save'd bytes."""
    losses = io.BytesIO()
    torch.save([4.2, 4.1], losses)
    return {"step": torch.tensor(STEP, dtype=torch.int32), "global_avg_losses": losses}


# The state dicts DCP checkpoints hold (model state dict, optimizer state dict, its flattened form):
LAYOUTS = {
    # torchtitan, 2025
    "titan": lambda msd, osd, flat: {"model": msd, "optimizer": flat, "train_state": _train_state()},
    "titan-flat": lambda msd, osd, flat: {**msd, "optimizer": flat, "train_state": _train_state()},  # torchtitan since
    "dcp-docs": lambda msd, osd, flat: {"model": msd, "optim": osd, "train_state": {"step": torch.tensor(STEP)}},
}


def _build(rank: int, world: int, init: str, strategy: str, seed: int):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    # tiny_config's model: rows of 64, 32, 96 and 128, which FSDP2 shards unevenly on 3 ranks.
    model = GPT(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2)
    if strategy in ("fsdp", "ddp"):
        model = parallel.wrap(model, strategy, [], torch.device("cpu"), world)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _train(model, optimizer, steps: int, rank: int, world: int) -> None:
    for step in range(steps):
        batch = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        lm_loss(model, batch.chunk(world)[rank]).backward()
        optimizer.step()


def _whole(model, optimizer) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors under DCP's flattened names, whole (DTensors gathered)."""
    msd, osd = get_state_dict(model, optimizer)
    full = {f"model.{k}": v for k, v in msd.items()}
    full |= {f"optim.state.{p}.{slot}": v for p, slots in osd["state"].items() for slot, v in slots.items()}
    return {
        k: (v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v).detach().clone()
        for k, v in full.items()
    }


def _save(rank: int, world: int, init: str, out: str) -> None:
    model, optimizer = _build(rank, world, init, "fsdp", seed=0)
    _train(model, optimizer, STEP, rank, world)
    root = str(Path(out, "ckpt"))
    named = list(state.unwrap(model).named_parameters())
    manifests = gathered_manifests(
        root, STEP, state.model_tensors(model), state.optim_tensors(named, optimizer), rank, world
    )
    msd, osd = get_state_dict(model, optimizer)
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    for layout, states in LAYOUTS.items():
        dcp.save(states(msd, osd, flat), checkpoint_id=str(Path(out, layout, f"step-{STEP}")))
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


def _restore_from_dcp(
    rank: int, world: int, init: str, out: str, strategy: str, full: bool, layout: str, label: str
) -> None:
    """Our rank's restore of DCP's checkpoint, as a job with `load_path` at the torchtitan folder does."""
    model, _ = _build(rank, world, init, strategy, seed=1)
    optimizer = MainParamsOptimizer(model, lr=0.05)
    _train(model, optimizer.optimizer, 1, rank, world)  # state to overwrite
    cfg = Config.from_dict(tiny_config(Path(out), training={"strategy": strategy}))
    start, _ = Checkpointer(cfg.checkpoint, None, rank, world, 0, None).restore(
        model, optimizer, DcpCheckpoint(dcp_checkpoint(str(Path(out, layout)))), full=full, global_batch_size=16
    )
    loaded = _whole(model, optimizer.optimizer)
    if rank == 0:
        save_file(
            loaded if full else {k: v for k, v in loaded.items() if k.startswith("model.")},
            str(Path(out, f"{label}.safetensors")),
        )
        Path(out, f"{label}.json").write_text(
            json.dumps({"step": start.step, "consumed": start.consumed_samples, "source": start.source})
        )
    dist.barrier()
    os._exit(0)


def _save_weights_and_moments_only(rank: int, world: int, init: str, out: str) -> None:
    model, optimizer = _build(rank, world, init, "plain", seed=0)
    _train(model, optimizer, 1, rank, world)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(out, "bare")))
    os._exit(0)


def _restore_bare(rank: int, world: int, init: str, out: str, step: int | None) -> None:
    """A full restore of a DCP checkpoint that does not say its step: the loop's `step=`, or refused."""
    model, _ = _build(rank, world, init, "plain", seed=1)
    cfg = Config.from_dict(tiny_config(Path(out)))
    try:
        start, _ = Checkpointer(cfg.checkpoint, None, rank, world, 0, None).restore(
            model,
            MainParamsOptimizer(model, lr=0.05),
            DcpCheckpoint(str(Path(out, "bare"))),
            full=True,
            global_batch_size=16,
            step=step,
        )
        Path(out, "bare.json").write_text(json.dumps([start.step, start.consumed_samples]))
    except CheckpointError as exc:
        Path(out, "bare.json").write_text(json.dumps(str(exc)))
    os._exit(0)


def _bf16_resume(rank: int, world: int, init: str, out: str) -> None:
    """A bf16 model saved by plain AdamW in torchtitan's layout, resumed whole into the built-in job's
    optimizer, which keeps fp32 main params: they start from the loaded weights."""
    model, optimizer = _build(rank, world, init, "plain", seed=0)
    model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, optimizer, 1, rank, world)
    msd, osd = get_state_dict(model, optimizer)
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save(LAYOUTS["titan"](msd, osd, flat), checkpoint_id=str(Path(out, "bf16", f"step-{STEP}")))
    fresh, _ = GPT(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2).to(torch.bfloat16), None
    ours = MainParamsOptimizer(fresh, lr=0.05)
    cfg = Config.from_dict(tiny_config(Path(out), model={"dtype": "bfloat16"}))
    start, _ = Checkpointer(cfg.checkpoint, None, rank, world, 0, None).restore(
        fresh, ours, DcpCheckpoint(str(Path(out, "bf16", f"step-{STEP}"))), full=True, global_batch_size=16
    )
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    mains = all(torch.equal(main, p.float()) for main, p in zip(ours.main, fresh.parameters()))
    moments = all(
        torch.equal(optimizer.state[p]["exp_avg"].float(), ours.optimizer.state[m]["exp_avg"])
        for p, m in zip(model.parameters(), ours.main)
    )
    Path(out, "bf16.json").write_text(json.dumps([start.step, same, mains, moments]))
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
    assert (
        held.keys() == loaded.keys()
        and any(k.endswith(".exp_avg_sq") for k in held)
        and any(k.endswith(".step") for k in held)
    )
    for name in held:
        assert held[name].dtype == loaded[name].dtype and torch.equal(held[name], loaded[name]), name
    size = sum(
        p.stat().st_size
        for p in Path(paths.iteration_dir(str(saved / "ckpt"), STEP)).iterdir()
        if paths.parse_shard_filename(p.name)
    )
    reads = json.loads((saved / f"{label}.json").read_text())["bytes_read"]
    assert all(n > 0 for n in reads) and sum(reads) >= size  # every byte of the root, some read by more than one rank
    print(
        f"{label}: DCP's load read {sum(reads)} bytes of a {size}-byte iteration ({sum(reads) / size:.2f}x), per rank {reads}"
    )


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
    assert (
        f"{shard}: xxh3-128 does not match metadata.json (checksum block" in error and "the shard is corrupt" in error
    ), error


def test_an_iteration_that_is_not_committed_is_refused(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    shutil.copytree(
        paths.iteration_dir(str(tmp_path / "ckpt"), STEP), paths.iteration_dir(str(tmp_path / "ckpt"), STEP + 1)
    )
    spawn(_load_failing, 1, tmp_path, STEP + 1)
    error = (tmp_path / "error.txt").read_text()
    assert f"iteration {STEP + 1} is not committed (the tracker names {STEP})" in error, error


def test_dcps_own_whole_checkpoint_load_takes_every_tensor_without_a_process_group(saved):
    """`format_utils.dcp_to_torch_save`'s call with our reader in place of its FileSystemReader: an
    empty state dict that DCP's planner fills from the metadata alone, in one process."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    everything: dict = {}
    _load_state_dict(
        everything, storage_reader=Reader(saved / "ckpt"), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    held = load_file(str(saved / "held.safetensors"))
    assert held.keys() <= everything.keys()
    for name in held:
        assert torch.equal(held[name], everything[name]), name


# ----------------------------------------------------------------------------- DCP's checkpoints, resumed
@pytest.mark.parametrize(
    "layout, strategy, world, full",
    [
        ("titan", "ddp", 1, False),
        ("titan", "fsdp", 3, True),
        ("titan-flat", "ddp", 2, True),
        ("dcp-docs", "fsdp", 3, True),
    ],
)
def test_our_restore_takes_dcps_checkpoint_on_another_world_size(saved, layout, strategy, world, full):
    """Weights, and with a full resume Adam's moments and steps and the step of `train_state`, equal
    to what the job held, from each layout."""
    label = f"from-{layout}-{strategy}{world}-{full}"
    spawn(_restore_from_dcp, world, saved, strategy, full, layout, label)
    held, loaded = load_file(str(saved / "held.safetensors")), load_file(str(saved / f"{label}.safetensors"))
    wanted = {k: v for k, v in held.items() if full or k.startswith("model.")}
    assert wanted.keys() == loaded.keys() and (not full or any(k.endswith(".exp_avg_sq") for k in loaded))
    for name in wanted:
        assert torch.equal(wanted[name], loaded[name]), name
    step = STEP if full else 0
    assert json.loads((saved / f"{label}.json").read_text()) == {
        "step": step,
        "consumed": 16 * step,
        "source": str(saved / layout / f"step-{STEP}"),
    }


def test_a_job_started_from_a_torchtitan_folder_is_the_job_started_from_our_root_of_the_same_weights(saved, tmp_path):
    """Weights only, as the driver resolves it: the newest `step-N/` of the folder; the run then
    writes, step by step, the bytes of the same job started from our root of the same step."""
    runs = {}
    for label, load_path in (("dcp", saved / "titan"), ("ours", saved / "ckpt")):
        cfg = tiny_config(
            tmp_path / label,
            checkpoint={"load_path": str(load_path), "no_load_optim": True},
            data={"path": str(tmp_path / "data")},
        )
        if label == "dcp":
            assert driver_checks(cfg) == DcpCheckpoint(str(saved / "titan" / f"step-{STEP}"))
        run_on_harness(cfg)
        runs[label] = shard_bytes(tmp_path / label / "ckpt", cfg["training"]["train_steps"])
    assert runs["dcp"] == runs["ours"] and runs["dcp"]


@pytest.mark.parametrize("layout", ["titan", "titan-flat"])
def test_a_job_resumes_a_torchtitan_checkpoint_whole_at_its_step(saved, tmp_path, layout):
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(saved / layout)}, data={"path": str(tmp_path / "data")})
    assert driver_checks(cfg) == DcpCheckpoint(str(saved / layout / f"step-{STEP}"))
    run_on_harness(cfg)
    starts = [r for r in read_metrics(str(tmp_path / "ckpt")) if r.get("event") == "start" and r["rank"] == 0]
    assert [(r["step"], r["source"]) for r in starts] == [(STEP, str(saved / layout / f"step-{STEP}"))]


def test_a_dcp_checkpoint_without_its_step_is_refused_a_full_resume(saved, tmp_path):
    bare = tmp_path / "bare"
    spawn(_save_weights_and_moments_only, 1, tmp_path)
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(bare)})
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"{bare}: a torch.distributed.checkpoint (DCP) checkpoint that cannot be resumed whole: it holds no train_state.step "
            "(an integer, as torchtitan's TrainState saves it), so the step it was taken at is unknown; set "
            "checkpoint.no_load_optim: true to start from its weights"
        ),
    ):
        driver_checks(cfg)
    assert isinstance(
        driver_checks(tiny_config(tmp_path, checkpoint={"load_path": str(bare), "no_load_optim": True})), DcpCheckpoint
    )
    # A fit() loop may say the step itself: its driver lets it through, its ranks take `step=` or refuse.
    fit_job = Config.from_dict(tiny_config(tmp_path, checkpoint={"load_path": str(bare)}, training=None))
    assert resolve_source(fit_job) == (DcpCheckpoint(str(bare)), None)
    spawn(_restore_bare, 1, tmp_path, 7)
    assert json.loads((tmp_path / "bare.json").read_text()) == [7, 7 * 16]
    spawn(_restore_bare, 1, tmp_path, None)
    assert json.loads((tmp_path / "bare.json").read_text()) == (
        f"{bare}: a DCP checkpoint without train_state.step: say the step it was taken at, ck.restore(..., step=N), or set "
        "checkpoint.no_load_optim: true to start from its weights"
    )


@pytest.mark.parametrize(
    "change, error",
    [
        (
            {"model": {"d_model": 16}},
            "{titan}/step-2: tensor 'tok.weight' is torch.float32 [64, 32] there but torch.float32 [64, 16] in the model",
        ),
        (
            {
                "checkpoint": {"no_load_optim": False},
                "training": {"optimizer": "torch.optim.SGD", "optimizer_args": {"momentum": 0.9}},
            },
            "{titan}/step-2 holds optimizer state 'adam_m.tok.weight' (torch's 'exp_avg'), but training.optimizer builds "
            "torch.optim.sgd:SGD, which keeps ['momentum_buffer']; set checkpoint.no_load_optim: true to start torch.optim.sgd:SGD from "
            "its weights, or set training.optimizer to the one that saved it",
        ),
    ],
)
def test_what_cannot_start_from_dcps_checkpoint_is_refused_on_the_driver(saved, tmp_path, change, error):
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(saved / "titan"), "no_load_optim": True})
    for section, values in change.items():
        cfg[section].update(values)
    with pytest.raises(CheckpointError) as refused:
        driver_checks(cfg)
    assert error.format(titan=saved / "titan") in str(refused.value)


def test_a_low_precision_model_resumes_dcps_checkpoint_whole_with_main_params_from_its_weights(tmp_path):
    spawn(_bf16_resume, 1, tmp_path)
    assert json.loads((tmp_path / "bf16.json").read_text()) == [STEP, True, True, True]


def test_a_dcp_checkpoint_with_a_truncated_file_is_refused_on_the_driver(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "titan", tmp_path / "titan")
    shard = tmp_path / "titan" / f"step-{STEP}" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{shard}: 100 bytes, but ")
        + ".*"
        + re.escape(f"; the DCP checkpoint at {tmp_path / 'titan' / f'step-{STEP}'} is damaged or incomplete"),
    ):
        driver_checks(tiny_config(tmp_path, checkpoint={"load_path": str(tmp_path / "titan")}))


def test_dcps_metadata_is_read_without_running_what_a_pickle_names(saved, tmp_path):
    """torch writes `.metadata` with pickle; ours reads DCP's classes alone: the same Metadata as
    DCP's own reader, and a file that would run a command is refused, the command not run."""
    from torch.distributed.checkpoint import FileSystemReader

    step = dcp_checkpoint(str(saved / "titan"))
    assert read_dcp_metadata(step).state_dict_metadata == FileSystemReader(step).read_metadata().state_dict_metadata
    evil = tmp_path / "evil"
    evil.mkdir()

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    (evil / DCP_METADATA).write_bytes(__import__("pickle").dumps(RunsCode()))
    with pytest.raises(CheckpointError, match=r"refers to posix\.system, which DCP's metadata never holds; not read"):
        read_dcp_metadata(str(evil))
    assert not (tmp_path / "ran").exists()


def test_ray_resume_show_and_verify_describe_a_dcp_checkpoint(saved, tmp_path, capsys):
    import shutil

    from ray_resume.cli import main

    step = saved / "titan" / f"step-{STEP}"
    assert main(["verify", str(saved / "titan")]) == 0
    assert f"OK: {step}: 2 files, " in capsys.readouterr().out
    assert main(["verify", str(saved / "titan"), "--iteration", str(STEP)]) == 0
    assert f"OK: {step}: 2 files, " in capsys.readouterr().out
    assert main(["show", str(saved / "titan")]) == 0
    shown = capsys.readouterr().out
    assert (
        "a torch.distributed.checkpoint (DCP) checkpoint" in shown
        and "model.tok.weight" in shown
        and "[64, 32]" in shown
    )
    shutil.copytree(saved / "titan", tmp_path / "titan")
    shard = tmp_path / "titan" / f"step-{STEP}" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["verify", str(tmp_path / "titan")]) == 1
    out = capsys.readouterr().out
    assert f"FAILED: {tmp_path / 'titan' / f'step-{STEP}'}:" in out and f"  - {shard}: 100 bytes, but " in out, out


def test_a_chunk_of_rows_of_no_element_has_its_shape_and_offset():
    """A tensor whose rows hold no element ([3, 0]) is one chunk of its 3 empty rows (the writer's
    rule), at row 0: DCP's metadata of it, not a division by its zero row size."""
    from ray_resume.checkpoint.interop.dcp import Chunk
    from ray_resume.checkpoint.format.plan import Piece, TensorSpec

    chunk = Chunk("f", TensorSpec("t", "F32", (3, 0), 4), Piece("t", 0, 0))
    assert (chunk.shape, chunk.offset) == ((3, 0), (0, 0))
