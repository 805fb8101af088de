"""Fallback to an older iteration, and refusals of broken input that leave storage untouched."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
import xxhash

import harness
from conftest import FINAL, driver_checks, run_on_harness, shard_bytes, tiny_config
from ray_resume.checkpoint.format import paths, state
from ray_resume.checkpoint.checkpointer import Checkpointer
from ray_resume.checkpoint.io.lease import LEASE_DIR
from ray_resume.checkpoint.root import CheckpointRoot, CommittedIteration
from ray_resume.preflight import resolve_source
from ray_resume.checkpoint.format.digest import block_bounds
from ray_resume.checkpoint.fallback import select_iteration
from ray_resume.checkpoint.loader import StateLoader
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.config import Config
from ray_resume.metrics import read_metrics
from ray_resume.model import GPT
from ray_resume.optim import MainParamsOptimizer
from test_checkpoint_format import make_state, tree, write_iteration


@pytest.fixture
def root(tmp_path):
    """Iterations 5 and 10 of one run, tracker on 10."""
    model, opt = make_state()
    write_iteration(tmp_path / "ckpt", world=2, step=5, model=model, opt=opt)
    write_iteration(tmp_path / "ckpt", world=2, step=10, model=model, opt=opt)
    return tmp_path / "ckpt"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_intact_tracker_iteration_is_used(root):
    assert select_iteration(CheckpointRoot(str(root)), fallback=True).step == 10


def restore(root: Path, step: int, **checkpoint):
    """What a rank of a 1-rank group loads from `(root, step)`: its resume point."""
    model, opt = make_state(seed=4)
    cfg = Config.from_dict(tiny_config(root.parent, checkpoint=checkpoint))
    return Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
        model, opt, CommittedIteration(str(root), step), full=True
    )[0]


@pytest.mark.parametrize("stepped", [True, False])
def test_a_restore_reads_straight_into_the_live_tensors(root, monkeypatch, stepped):
    """Every model tensor, and each slot a stepped optimizer already holds, is filled in place:
    the loader hands back the live storage itself, holding the saved bytes. A fresh optimizer's
    slots come as new tensors."""
    saved_model, saved_opt = make_state()
    model, opt = make_state(seed=4)
    if not stepped:
        opt = MainParamsOptimizer(model, lr=1e-2, weight_decay=0.0)  # no slots yet
    live = {**state.model_tensors(model), **opt.state_tensors()}
    pointers = {n: t.data_ptr() for n, t in live.items()}
    returned: dict[str, torch.Tensor] = {}
    load = StateLoader.load
    monkeypatch.setattr(StateLoader, "load", lambda self, *a, **kw: returned.update(out := load(self, *a, **kw)) or out)
    cfg = Config.from_dict(tiny_config(root.parent))
    Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(model, opt, CommittedIteration(str(root), 10), full=True)
    saved = {**state.model_tensors(saved_model), **saved_opt.state_tensors()}
    assert returned.keys() == saved.keys()
    for name, t in {**state.model_tensors(model), **opt.state_tensors()}.items():
        assert torch.equal(t, saved[name]), name
        in_place = returned[name].data_ptr() == pointers.get(name) == t.data_ptr()
        assert in_place == (name in pointers), name
    assert len(pointers) == (len(saved) if stepped else len(state.model_tensors(model)))


def read_chars() -> int:
    """Bytes this process has read through read(2) and friends so far (/proc/self/io rchar)."""
    return int(
        next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:")).split()[1]
    )


@pytest.mark.invariant(7, 12)
def test_the_driver_reads_metadata_not_shards_and_the_ranks_find_the_damage(tmp_path, caplog):
    """Choosing what to resume reads the tracker and the JSON only (<10% of the checkpoint),
    even when a shard's bytes are damaged; the loading ranks find the damage, fall back loudly
    to the next older iteration and set the damaged one aside."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=8, d_model=256, n_layers=2, n_heads=4)
    opt = MainParamsOptimizer(model, lr=1e-2, weight_decay=0.0)
    opt.backward(model(torch.randint(0, 32, (2, 8))).float().sum())
    opt.step()
    root = tmp_path / "ckpt"
    for step in (5, 10):
        write_iteration(root, world=2, step=step, model=model, opt=opt)
    flip_byte(root / "iteration_00000010" / "ckpt-opt-0000001-0000002.safetensors")
    checkpoint_bytes = sum(p.stat().st_size for p in (root / "iteration_00000010").iterdir())
    cfg = Config.from_dict(tiny_config(tmp_path, checkpoint={"load_path": str(root), "save_path": str(root)}))
    before = read_chars()
    assert resolve_source(cfg)[0] == CommittedIteration(str(root), 10)
    driver_read = read_chars() - before
    assert checkpoint_bytes > 10_000_000 and driver_read < 0.1 * checkpoint_bytes, (driver_read, checkpoint_bytes)

    big = GPT(vocab_size=32, seq_len=8, d_model=256, n_layers=2, n_heads=4)
    with caplog.at_level(logging.WARNING):
        point, _ = Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
            big, MainParamsOptimizer(big, lr=1e-2, weight_decay=0.0), CommittedIteration(str(root), 10), full=True
        )
    assert point.consumed_samples == 8 * 5 and point.source.endswith("iteration_00000005")
    assert "ckpt-opt-0000001-0000002.safetensors: xxh3-128 does not match metadata.json" in caplog.text
    assert "Resuming from iteration 5 instead" in caplog.text
    names = sorted(p.name for p in root.iterdir())
    assert "iteration_00000010" not in names and any(n.startswith("iteration_00000010.damaged-") for n in names)


@pytest.mark.invariant(7)
def test_a_storage_error_is_not_damage(root, monkeypatch):
    """A read that fails (EIO) is raised as it is: nothing is set aside, no fallback."""
    before = tree(root)
    real = LocalStorage.read_bytes

    def read_bytes(self, path):
        if path.endswith(f"iteration_00000010/{paths.METADATA}"):
            raise OSError(errno.EIO, "injected EIO", path)
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "read_bytes", read_bytes)
    with pytest.raises(OSError, match="injected EIO"):
        select_iteration(CheckpointRoot(str(root)), fallback=True)
    assert tree(root) == before


@pytest.mark.invariant(7, 10)
def test_an_iteration_that_disagrees_with_itself_is_damage_and_falls_back(root, caplog):
    """A common.json of step 5 in iteration_00000010/ (copied, edited): resuming it would redo steps
    6-10 and then save over committed iterations."""
    common_file = root / "iteration_00000010" / "common.json"
    common_file.write_text(json.dumps({**json.loads(common_file.read_text()), "global_step": 5}))
    with caplog.at_level(logging.WARNING):
        assert select_iteration(CheckpointRoot(str(root)), fallback=True).step == 5
    assert "global_step 5 is not this directory's iteration 10" in caplog.text


@pytest.mark.invariant(6, 7)
def test_no_fallback_lists_the_valid_iterations_and_changes_nothing(root):
    flip_byte(root / "iteration_00000010" / "ckpt-model-0000000-0000002.safetensors")
    before = tree(root)
    with pytest.raises(CheckpointError) as err:
        restore(root, 10, fallback=False)
    assert "xxh3-128 does not match" in str(err.value) and "Iterations that check out: [5]" in str(err.value)
    assert tree(root) == before


@pytest.mark.parametrize("tracker", ["", "abc", "-1", "99", None])
@pytest.mark.invariant(6, 7)
def test_missing_or_garbled_tracker_with_valid_iterations(root, tracker):
    if tracker is None:
        (root / paths.TRACKER).unlink()
    else:
        (root / paths.TRACKER).write_text(tracker)
    assert select_iteration(CheckpointRoot(str(root)), fallback=True).step == 10
    with pytest.raises(CheckpointError, match=r"Iterations that check out: \[10, 5\]"):
        select_iteration(CheckpointRoot(str(root)), fallback=False)


def lie_about_offsets(directory: Path) -> None:
    """A shard whose safetensors header claims more bytes than the file holds (sizes and digests fixed up to match)."""
    shard = directory / "ckpt-model-0000000-0000002.safetensors"
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096
    raw = json.dumps(header).encode()
    raw += b" " * (length - len(raw)) if len(raw) <= length else b""
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    meta = json.loads((directory / "metadata.json").read_text())
    data = shard.read_bytes()
    ours = meta["ray_resume"]
    bounds = block_bounds(len(data), 8 + len(raw), ours["block_size"])
    ours["files"][shard.name].update(
        size=len(data), data_start=8 + len(raw), digests=[xxhash.xxh3_128(data[lo:hi]).hexdigest() for lo, hi in bounds]
    )
    (directory / "metadata.json").write_text(json.dumps(meta))


def shape_mismatch(directory: Path) -> None:
    meta = json.loads((directory / "metadata.json").read_text())
    head = meta["state_dict_metadata"]["head.weight"]
    head["global_shape"] = head["chunk"][0]["local_shape"] = [16, 32]  # the same bytes, another shape
    (directory / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lie_about_offsets, "piece does not match metadata.json"),
        (
            shape_mismatch,
            "tensor 'head.weight' is torch.float32 [16, 32] there but torch.float32 [32, 16] in the model",
        ),
    ],
)
@pytest.mark.invariant(6, 7)
def test_lying_shards_are_refused_by_name_through_the_loader(root, damage, message):
    damage(root / "iteration_00000010")
    before = tree(root)
    with pytest.raises(CheckpointError) as err:
        restore(root, 10, fallback=False)
    assert message in str(err.value) and "iteration_00000010" in str(err.value)
    assert tree(root) == before


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: str(tmp / "nowhere"), "does not exist or is not a directory"),
        (
            lambda tmp: (tmp / "file.txt").write_text("x") and str(tmp / "file.txt"),
            "does not exist or is not a directory",
        ),
        (
            lambda tmp: (tmp / "empty").mkdir() or str(tmp / "empty"),
            "holds neither latest_checkpointed_iteration.txt nor model.safetensors",
        ),
    ],
)
@pytest.mark.invariant(6, 13)
def test_bad_load_path_is_refused_by_key(tmp_path, make, message):
    path = make(tmp_path)
    cfg = Config.from_dict(tiny_config(tmp_path, checkpoint={"load_path": path}))
    with pytest.raises(CheckpointError) as err:
        resolve_source(cfg)[0]
    assert "checkpoint.load_path" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    "fault", [None, {"phase": "after_optimizer_step", "step": 10, "rank": 1}], ids=["clean", "killed-before-a-commit"]
)
@pytest.mark.invariant(7)
def test_resume_falls_back_past_a_corrupt_newest_iteration(tmp_path, local_reference, fault):
    """The whole job (on the in-process harness): the driver names 12, the ranks find its damage,
    set it aside, load 8 and redo 9-12 to the very bytes of the reference run. Killed at step 10,
    before it commits anything, the restarted group (which the driver's choice still sends to 12)
    falls back to 8 the same way."""
    root = tmp_path / "ckpt"
    shutil.copytree(local_reference["root"], root)
    flip_byte(root / "iteration_00000012" / "ckpt-model-0000001-0000002.safetensors")
    (root / paths.TRACKER).write_text("12\n")
    cfg = tiny_config(tmp_path, training={"train_steps": FINAL}, checkpoint={"load_path": str(root)})
    cfg["data"]["path"] = local_reference["data"]
    assert run_on_harness(cfg, fault).attempts == (2 if fault else 1)
    assert len([p for p in root.iterdir() if p.name.startswith("iteration_00000012.damaged-")]) == 1
    starts = [r for r in read_metrics(str(root)) if r.get("event") == "start" and r["rank"] == 0]
    assert [r["source"].rsplit("/", 1)[1] for r in starts] == ["iteration_00000008"] * (2 if fault else 1)
    assert shard_bytes(root, FINAL) == shard_bytes(local_reference["root"], FINAL)  # redone from 8, the same bytes


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": 8}, "data.seed 7 -> 8"),
        ({"shuffle": False}, "data.shuffle true -> false"),
    ],
)
@pytest.mark.invariant(3, 13)
def test_a_resume_on_other_data_is_refused_naming_the_change(tmp_path, local_reference, change, message):
    """The data order depends on the seed, shuffle, columns and dataset; common.json records them, and a
    full resume that would continue another order is refused before Ray starts, unless it is meant."""

    root = tmp_path / "ckpt"
    shutil.copytree(local_reference["root"], root)
    before = tree(root)
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(root)})
    cfg["data"] = {**cfg["data"], "path": local_reference["data"], **change}
    with pytest.raises(CheckpointError) as err:
        driver_checks(cfg)
    assert message in str(err.value) and "iteration 12 was trained on other data" in str(err.value)
    assert "set data.allow_change: true" in str(err.value) and str(root / "iteration_00000012" / "common.json") in str(
        err.value
    )
    assert tree(root) == before
    cfg["data"]["allow_change"] = True
    assert driver_checks(cfg) == CommittedIteration(str(root), 12)
    del cfg["data"]["allow_change"]
    cfg["checkpoint"]["no_load_optim"] = True  # weights only: starts at sample 0, nothing to continue
    cfg["checkpoint"]["save_path"] = str(tmp_path / "fresh")
    assert driver_checks(cfg) == CommittedIteration(str(root), 12)


@pytest.mark.invariant(3)
def test_another_dataset_is_refused_but_a_moved_copy_is_not(tmp_path, local_reference):

    root = tmp_path / "ckpt"
    shutil.copytree(local_reference["root"], root)
    moved = tmp_path / "moved"
    shutil.copytree(local_reference["data"], moved)
    cfg = tiny_config(tmp_path, checkpoint={"load_path": str(root)})
    cfg["data"]["path"] = str(moved)
    assert driver_checks(cfg) == CommittedIteration(str(root), 12)
    sorted(moved.glob("*.parquet"))[-1].unlink()
    with pytest.raises(CheckpointError, match=r"the dataset at data.path: \d+ samples in \d+ row groups -> \d+ in \d+"):
        driver_checks(cfg)


def test_fingerprint_changes_name_each_setting():
    from ray_resume.data import ReadUnit, data_fingerprint, fingerprint_changes

    units = [ReadUnit("/a/part-0.parquet", 0, 10), ReadUnit("/a/part-0.parquet", 1, 6)]
    saved = data_fingerprint(units, 7, True, {"x": "float32"})
    assert (
        fingerprint_changes(
            saved,
            data_fingerprint(
                [ReadUnit("/elsewhere/part-0.parquet", u.row_group, u.num_rows) for u in units],
                7,
                True,
                {"x": "float32"},
            ),
        )
        == []
    )
    assert fingerprint_changes(saved, data_fingerprint(units, 7, True, {"x": "float32", "y": "int64"})) == [
        'data.columns {"x": "float32"} -> {"x": "float32", "y": "int64"}'
    ]
    assert fingerprint_changes(saved, data_fingerprint(units[::-1], 7, True, {"x": "float32"})) == [
        "the dataset at data.path: 16 samples in 2 row groups -> 16 in 2 (other files or row groups)"
    ]


@pytest.mark.invariant(6, 13)
def test_weights_that_do_not_fit_the_model_are_refused_on_the_driver(tmp_path):
    """Checked before any rank starts (each rank would find it again in every attempt), against the
    model built on the meta device: the checkpoint's shapes, and an export's."""
    from ray_resume import cli

    write_iteration(tmp_path / "ckpt", world=2)  # make_state's GPT: vocab 32, d_model 16; tiny_config's: 64, 32
    root = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as err:
        harness.run_job(tiny_config(tmp_path, checkpoint={"save_path": str(tmp_path / "new"), "load_path": root}))
    assert str(err.value) == (
        f"{root}/iteration_00000005/metadata.json: tensor 'tok.weight' is torch.float32 [32, 16] there but "
        "torch.float32 [64, 32] in the model; the model config differs from the one that saved it"
    )
    assert cli.main(["export", root, str(tmp_path / "export")]) == 0
    with pytest.raises(CheckpointError) as err:
        harness.run_job(
            tiny_config(
                tmp_path,
                checkpoint={
                    "save_path": str(tmp_path / "new"),
                    "load_path": str(tmp_path / "export"),
                    "no_load_optim": True,
                },
            )
        )
    assert str(err.value).startswith(
        f"{tmp_path / 'export'}: tensor 'tok.weight' is torch.float32 [32, 16] there but torch.float32 [64, 32]"
    )
    # no rank ran: the driver took the lease, then refused
    assert [p.name for p in (tmp_path / "new").iterdir()] == [LEASE_DIR]


class Wrapped(torch.nn.Module):
    """The saved GPT one module down, as Hugging Face's *LMHeadModel holds its .transformer."""

    def __init__(self):
        super().__init__()
        self.transformer = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)


@pytest.mark.invariant(6)
def test_names_one_module_apart_get_a_hint(tmp_path):
    write_iteration(tmp_path / "ckpt", world=2)
    root = str(tmp_path / "ckpt")
    cfg = tiny_config(tmp_path, checkpoint={"save_path": str(tmp_path / "new"), "load_path": root})
    with pytest.raises(CheckpointError) as err:
        harness.run_job(cfg, build_model=lambda section: Wrapped())
    assert str(err.value) == (
        f"{root}/iteration_00000005/metadata.json: model tensor 'transformer.tok.weight' is missing (the model's names are the "
        "saved ones with 'transformer.' in front: your model holds the saved one as .transformer); the model config differs "
        "from the one that saved it"
    )


@pytest.mark.invariant(6)
def test_a_restore_into_another_optimizer_class_is_refused_by_the_ranks_too(tmp_path):
    """What the driver checks for the built-in job (test_recipe.py) the ranks check for any job
    (ray_resume.fit's), before a foreign slot is loaded."""
    write_iteration(tmp_path / "ckpt", world=1)
    meta = tmp_path / "ckpt" / "iteration_00000005" / "metadata.json"
    saved = json.loads(meta.read_text())
    saved["ray_resume"]["optimizer"] = "torch.optim.sgd:SGD"
    meta.write_text(json.dumps(saved))
    with pytest.raises(
        CheckpointError,
        match=r"iteration 5 holds the state of optimizer torch.optim.sgd:SGD, but this job's "
        r"optimizer is torch.optim.adamw:AdamW; set checkpoint.no_load_optim: true",
    ):
        restore(tmp_path / "ckpt", 5)


def test_the_prefix_hint_looks_past_names_outside_the_prefix():
    from ray_resume.checkpoint.format.checks import prefix_hint

    saved = {"transformer.wte.weight", "transformer.h.0.attn.weight", "lm_head.weight"}  # lm_head sorts first
    assert prefix_hint({"wte.weight", "h.0.attn.weight"}, saved) == (
        " (the saved names are the model's with 'transformer.' in front: they are of a model that holds yours as .transformer)"
    )
    assert prefix_hint({"wte.weight"}, {"other.weight"}) == ""
