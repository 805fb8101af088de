"""Scenario B (weights-only start), mixed precision with fp32 main params, optimizer-less checkpoints.

Whole jobs run on the in-process harness (tests/harness.py: real gloo ranks, no Ray)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import harness

from conftest import (
    FINAL,
    KILL_AT_6,
    assert_resumed_once,
    driver_checks,
    per_step,
    read_metrics,
    run_on_harness,
    shard_bytes,
    tiny_config,
)
from ray_resume.checkpoint.format import paths, state
from ray_resume.checkpoint.checkpointer import Checkpointer
from ray_resume.checkpoint.root import CommittedIteration, WeightsExport
from ray_resume.preflight import resolve_source
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.config import Config
from ray_resume.model import GPT, lm_loss
from ray_resume.optim import LossScaler, MainParamsOptimizer
from test_checkpoint_format import make_state, tree, write_iteration


def test_weights_only_load_refreshes_the_fp32_main_params(tmp_path):
    """Without reload_main_params_from_model the first step would write the random init back."""
    saved, saved_opt = make_state(seed=1, dtype=torch.bfloat16)
    write_iteration(tmp_path, world=2, model=saved, opt=saved_opt)
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2).to(torch.bfloat16)
    optimizer = MainParamsOptimizer(model, lr=1e-2, weight_decay=0.0)
    cfg = Config.from_dict(tiny_config(tmp_path))
    Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
        model, optimizer, CommittedIteration(str(tmp_path), 5), full=False
    )
    optimizer.zero_grad()
    optimizer.step()  # no gradients: Adam moves nothing, so the weights must stay the loaded ones
    for name, tensor in state.model_tensors(saved).items():
        assert torch.equal(state.model_tensors(model)[name], tensor), name


def test_mixed_precision_checkpoint_carries_the_main_params(tmp_path):
    model, opt = make_state(dtype=torch.bfloat16)
    write_iteration(tmp_path, world=2, model=model, opt=opt)
    storage = LocalStorage()
    it = open_iteration(storage, str(tmp_path), 5)
    assert {spec.dtype for spec in it.specs("model").values()} == {"BF16"}
    mains = {n: t for n, t in load_state(storage, it, "opt").items() if n.startswith("main_param.")}
    assert mains and all(t.dtype == torch.float32 for t in mains.values())
    fresh, fresh_opt = make_state(seed=3, dtype=torch.bfloat16)
    fresh_opt.load_state_tensors(load_state(storage, it, "opt"))
    assert len(fresh_opt.main) == len(opt.main) > 0
    for a, b in zip(fresh_opt.main, opt.main):
        assert torch.equal(a, b)


def test_loss_scaler_backs_off_skips_and_grows():
    scaler = LossScaler(scale=1024.0, growth_interval=2)
    scaler.update(finite=False)
    assert scaler.scale == 512.0
    scaler.update(finite=True)
    scaler.update(finite=True)
    assert scaler.scale == 1024.0
    restored = LossScaler()
    restored.load(scaler.state())
    assert restored.state() == scaler.state()
    model = GPT(vocab_size=8, seq_len=4, d_model=8, n_layers=1, n_heads=2).to(torch.float16)
    opt = MainParamsOptimizer(model, lr=1e-2, weight_decay=0.0)
    before = {n: t.clone() for n, t in state.model_tensors(model).items()}
    opt.backward(model(torch.zeros(1, 4, dtype=torch.long)).float().sum() * float("inf"))
    assert opt.step() is False and opt.loss_scale == 2.0**15  # overflow: step skipped, scale halved
    assert all(torch.equal(before[n], t) for n, t in state.model_tensors(model).items())


@pytest.mark.invariant(6)
def test_export_with_a_mismatched_tensor_is_refused_by_name(tmp_path):
    from ray_resume import cli

    model, opt = make_state()  # vocab 32
    write_iteration(tmp_path / "root", world=2, model=model, opt=opt)
    assert cli.main(["export", str(tmp_path / "root"), str(tmp_path / "export")]) == 0
    torch.manual_seed(0)
    other = GPT(vocab_size=40, seq_len=8, d_model=16, n_layers=1, n_heads=2)  # another vocabulary
    other_opt = MainParamsOptimizer(other, lr=1e-2, weight_decay=0.0)
    before = {n: t.clone() for n, t in state.model_tensors(other).items()}
    cfg = Config.from_dict(tiny_config(tmp_path))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'tok.weight' is torch.float32 \[32, 16\] there but torch.float32 \[40, 16\] in the model",
    ):
        Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
            other, other_opt, WeightsExport(str(tmp_path / "export")), full=False
        )
    assert all(torch.equal(before[n], t) for n, t in state.model_tensors(other).items())  # nothing half-loaded


@pytest.mark.invariant(10, 13)
def test_weights_only_onto_its_own_committed_root_is_refused_naming_save_path(tmp_path):
    """Step 0 again, saving into the root whose committed iterations it loads, would overwrite them."""

    write_iteration(tmp_path / "ckpt", world=2)
    root = str(tmp_path / "ckpt")
    before = tree(tmp_path / "ckpt")
    saved_model = {"vocab_size": 32, "seq_len": 8, "d_model": 16, "n_layers": 1, "n_heads": 2}  # make_state's
    cfg = tiny_config(
        tmp_path, model=saved_model, checkpoint={"save_path": root, "load_path": root, "no_load_optim": True}
    )
    with pytest.raises(CheckpointError) as err:
        driver_checks(cfg)
    assert f"checkpoint.save_path {root!r} holds committed iteration 5" in str(err.value)
    assert "set checkpoint.save_path to a new directory" in str(err.value)
    assert tree(tmp_path / "ckpt") == before
    fresh = tiny_config(
        tmp_path,
        model=saved_model,
        checkpoint={"save_path": str(tmp_path / "new"), "load_path": root, "no_load_optim": True},
    )
    assert driver_checks(fresh) == CommittedIteration(root, 5)  # scenario B: a new root


def test_export_then_load_as_weights_round_trips_bitwise(tmp_path):
    from ray_resume import cli

    saved, saved_opt = make_state(seed=1)
    write_iteration(tmp_path / "root", world=3, model=saved, opt=saved_opt)
    out = tmp_path / "export"
    assert cli.main(["export", str(tmp_path / "root"), str(out)]) == 0
    cfg = Config.from_dict(tiny_config(tmp_path, checkpoint={"load_path": str(out), "no_load_optim": True}))
    assert resolve_source(cfg)[0] == WeightsExport(str(out))
    model, optimizer = make_state(seed=2)
    point, _ = Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
        model, optimizer, WeightsExport(str(out)), full=False
    )
    assert point.bytes_read == (out / "model.safetensors").stat().st_size  # what "rank 0 read N bytes" says
    for name, tensor in state.model_tensors(saved).items():
        assert torch.equal(state.model_tensors(model)[name], tensor), name
    full = Config.from_dict(tiny_config(tmp_path, checkpoint={"load_path": str(out)}))
    with pytest.raises(
        CheckpointError, match="is a weights-only safetensors export .* set checkpoint.no_load_optim: true"
    ):
        resolve_source(full)[0]


# ---- whole jobs -----------------------------------------------------------------------------


def first_batch_loss(local_reference, weights: dict) -> float:
    """The loss of `weights` on the first global batch of the order, computed here from the parquet rows."""
    ids = local_reference["steps"][1][0]["ids"]
    table = pq.ParquetDataset(local_reference["data"]).read().to_pydict()
    rows = dict(zip(table["sample_id"], table["input_ids"]))
    model = GPT(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        return lm_loss(model, torch.tensor([rows[i] for i in ids], dtype=torch.long)).item()


def test_scenario_b_starts_at_step_0_from_the_loaded_weights(tmp_path, local_reference):
    runs = []
    for name in ("b1", "b2"):
        cfg = tiny_config(
            tmp_path / name,
            model={"dropout": 0.0},
            checkpoint={"load_path": local_reference["root"], "no_load_optim": True},
        )
        cfg["data"]["path"] = local_reference["data"]
        run_on_harness(cfg)
        runs.append(cfg["checkpoint"]["save_path"])
    records = read_metrics(runs[0])
    start = [r for r in records if r.get("event") == "start" and r["rank"] == 0]
    assert [(r["step"], Path(r["source"]).name) for r in start] == [(0, "iteration_00000012")]
    steps = per_step(records)
    # the first batch of the order
    assert min(steps) == 1 and steps[1][0]["ids"] == local_reference["steps"][1][0]["ids"]
    storage = LocalStorage()
    weights = load_state(storage, open_iteration(storage, local_reference["root"], FINAL), "model")
    assert steps[1][0]["loss"] == pytest.approx(first_batch_loss(local_reference, weights), rel=1e-5)
    assert json.loads(Path(paths.iteration_dir(runs[0], 4), "common.json").read_text())["consumed_samples"] == 64
    for step in (4, FINAL):  # deterministic from there
        assert shard_bytes(runs[0], step) == shard_bytes(runs[1], step)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.invariant(2)
def test_mixed_precision_resumes_bit_exactly_with_its_loss_scale(tmp_path, local_reference, dtype):
    roots = {}
    for name, fault in (("clean", None), ("killed", KILL_AT_6)):
        cfg = tiny_config(tmp_path / name, model={"dtype": dtype})
        cfg["data"]["path"] = local_reference["data"]
        run_on_harness(cfg, fault, controller="CommitsFirst")  # 4 committed before the kill
        roots[name] = cfg["checkpoint"]["save_path"]
    assert_resumed_once(roots["killed"])
    for step in (4, 8, FINAL):
        assert shard_bytes(roots["killed"], step) == shard_bytes(roots["clean"], step)
        common = [json.loads(Path(paths.iteration_dir(r, step), "common.json").read_text()) for r in roots.values()]
        assert common[0]["loss_scale"] == common[1]["loss_scale"]
        assert common[0]["loss_scale"] == 1.0 if dtype == "bfloat16" else common[0]["loss_scale"] > 1.0
    killed = per_step(read_metrics(roots["killed"]))
    clean = per_step(read_metrics(roots["clean"]))
    assert {s: r[-1]["loss"] for s, r in killed.items()} == {s: r[0]["loss"] for s, r in clean.items()}


@pytest.mark.invariant(6, 13)
def test_no_save_optim_then_full_resume_is_refused_by_name(tmp_path, local_reference):
    cfg = tiny_config(tmp_path, training={"train_steps": 4}, checkpoint={"no_save_optim": True})
    cfg["data"]["path"] = local_reference["data"]
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    it = open_iteration(LocalStorage(), root, 4)
    assert it.has_optimizer is False and "opt" not in it.tensors
    assert not it.shard_files("opt") and not list(Path(it.path).glob("*-opt-*"))
    resume = tiny_config(tmp_path / "again", checkpoint={"load_path": root})
    resume["data"]["path"] = local_reference["data"]
    with pytest.raises(CheckpointError) as err:  # on the driver, before any rank would start
        driver_checks(resume)
    assert f"{it.path}: iteration 4 was saved without optimizer state" in str(err.value)
    assert "set checkpoint.no_load_optim: true" in str(err.value)


def test_enable_save_false_writes_nothing_and_says_so(tmp_path, local_reference, caplog):
    cfg = tiny_config(tmp_path, training={"train_steps": 4}, checkpoint={"enable_save": False})
    cfg["data"]["path"] = local_reference["data"]
    with caplog.at_level(logging.WARNING, logger="ray_resume"):
        outcome = harness.run_job(cfg)
    assert outcome.error is None and outcome.committed is None
    assert "checkpoints are off (checkpoint.enable_save: false)" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no checkpoint root, no metrics
