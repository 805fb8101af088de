"""The built-in job's recipe: any torch.optim optimizer, LR decay styles, gradient clipping."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch

import harness
from conftest import FINAL, KILL_AT_6, assert_resumed_once, read_metrics, run_on_harness, shard_bytes, tiny_config
from ray_resume.errors import CheckpointError
from ray_resume.config import Config
from ray_resume.errors import ConfigError
from ray_resume.model import GPT, lm_loss
from ray_resume.optim import MainParamsOptimizer
from ray_resume.plugins import resolve
from ray_resume.train_loop import learning_rate
from test_elastic import resume_root


def step_records(root) -> dict[int, dict]:
    """Each step's metrics record (lr, grad_norm, loss); a step run twice keeps its last run."""
    return {r["step"]: r for r in read_metrics(root) if "lr" in r}


def training(tmp_path, **values):
    return Config.from_dict(tiny_config(tmp_path, training=values)).training


def test_the_lr_is_a_pure_function_of_the_samples_consumed(tmp_path):
    """Warmup over warmup_steps x gbs samples from 0, then each style from lr to min_lr by train_steps x gbs."""
    # warmup 32 of 192 samples
    base = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2, "train_steps": 12, "global_batch_size": 16}
    lr = {
        style: (
            lambda c, t=training(tmp_path, lr_decay_style=style, wsd_decay_fraction=0.25, **base): learning_rate(t, c)
        )
        for style in ("constant", "linear", "cosine", "wsd")
    }
    for style, f in lr.items():
        assert (f(0), f(16), f(32)) == (0.0, 0.5, 1.0), style
    assert [lr["constant"](c) for c in (112, 192, 400)] == [1.0, 1.0, 1.0]
    assert (
        lr["linear"](112) == pytest.approx(0.55)
        and lr["linear"](192) == pytest.approx(0.1)
        and lr["linear"](400) == pytest.approx(0.1)
    )
    assert lr["cosine"](112) == pytest.approx(0.55) and lr["cosine"](72) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    )
    assert lr["cosine"](192) == pytest.approx(0.1)
    # wsd: stable until the last quarter of the 160 samples after warmup (sample 152), then linear to min_lr.
    assert [lr["wsd"](c) for c in (40, 152)] == [1.0, 1.0]
    assert lr["wsd"](172) == pytest.approx(0.55) and lr["wsd"](192) == pytest.approx(0.1)
    # Another global batch size, with train_steps and warmup_steps scaled to the same samples: the same curve.
    doubled = training(
        tmp_path, lr_decay_style="cosine", **{**base, "warmup_steps": 1, "train_steps": 6, "global_batch_size": 32}
    )
    assert all(learning_rate(doubled, c) == lr["cosine"](c) for c in range(0, 200, 8))


def test_grad_clip_is_torch_clip_grad_norm_on_the_whole_gradient():
    """SGD with momentum through MainParamsOptimizer, clipped, against torch's own clip_grad_norm_ + SGD."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    reference = copy.deepcopy(model)
    ours = MainParamsOptimizer(
        model,
        lr=0.1,
        weight_decay=0.01,
        optimizer_class=torch.optim.SGD,
        optimizer_args={"momentum": 0.9},
        grad_clip=0.05,
    )
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for step in range(3):
        ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(step))
        ours.zero_grad()
        ours.backward(lm_loss(model, ids))
        ours.step()
        theirs.zero_grad()
        lm_loss(reference, ids).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        theirs.step()
        assert float(norm) == pytest.approx(ours.grad_norm, rel=1e-5) and ours.grad_norm > 0.05  # the clip acted
        for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=name)
    assert set(ours.state_tensors()) == {f"momentum_buffer.{n}" for n, _ in model.named_parameters()}


def test_grad_clip_acts_on_the_unscaled_main_gradients_of_a_low_precision_model():
    """fp16 model, loss scaled by 2**16: the clip sees the unscaled fp32 gradient and leaves it at the limit."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2).to(torch.float16)
    ours = MainParamsOptimizer(model, lr=0.1, optimizer_class=torch.optim.SGD, grad_clip=0.05)
    ours.backward(lm_loss(model, torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))))
    assert ours.step() and ours.loss_scale > 1 and ours.grad_norm > 0.05
    clipped = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in ours.main]))
    assert float(clipped) == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"optimizer": "torch.optim.Nope"},
            "training.optimizer: module 'torch.optim' has no attribute 'Nope' (from 'torch.optim:Nope')",
        ),
        (
            {"optimizer": "collections:OrderedDict"},
            "training.optimizer: 'collections:OrderedDict' is not a torch.optim.Optimizer class",
        ),
        (
            {"optimizer": "torch.optim.SGD", "optimizer_args": {"momentun": 0.9}},
            "training.optimizer_args: SGD refuses {'momentun': 0.9}: SGD.__init__() got an unexpected keyword argument 'momentun'",
        ),
        (
            {"optimizer": "torch.optim.SGD", "optimizer_args": {"momentum": -1}},
            "training.optimizer_args: SGD refuses {'momentum': -1}: Invalid momentum value: -1",
        ),
        (
            {"optimizer": "torch.optim.LBFGS"},
            "training.optimizer: LBFGS.step needs a closure, and the built-in loop calls step() without "
            "one; use ray_resume.fit with your own loop for it",
        ),
    ],
)
@pytest.mark.invariant(6, 13)
def test_a_bad_optimizer_is_refused_on_the_driver_by_key(tmp_path, values, message):
    with pytest.raises(ConfigError) as err:
        resolve(Config.from_dict(tiny_config(tmp_path, training=values)))
    assert str(err.value) == message


@pytest.mark.invariant(6, 13)
def test_bad_recipe_values_are_refused_by_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(
            tiny_config(
                tmp_path, training={"lr_decay_style": "exp", "min_lr": 1.0, "grad_clip": -1, "optimizer": "SGD"}
            ),
            source="x.yaml",
        )
    assert err.value.problems == [  # in the section's key order; a value as written (-1, not -1.0)
        "x.yaml: training.lr_decay_style must be one of constant, linear, cosine, wsd; got 'exp'",
        "x.yaml: training.min_lr must be between 0 and training.lr (0.001), got 1.0",
        "x.yaml: training.optimizer must look like 'torch.optim.SGD' or 'package.module:Class', got 'SGD'",
        "x.yaml: training.grad_clip must be >= 0, got -1",
    ]


RECIPE = {
    "optimizer": "torch.optim.SGD",
    "optimizer_args": {"momentum": 0.9, "nesterov": True},
    "lr": 0.05,
    "min_lr": 0.005,
    "warmup_steps": 2,
    "lr_decay_style": "cosine",
    "grad_clip": 0.3,
}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.invariant(2, 3)
def test_a_rank_killed_under_the_recipe_ends_byte_identical(tmp_path, strategy):
    """SGD + Nesterov momentum, warmup + cosine, clipping (active: the norm is above it), dropout: a rank
    SIGKILLed after step 6 resumes from iteration 4 and every shard of the last iteration equals the
    uninterrupted run's."""
    runs = {}
    for name, fault in (("clean", None), ("killed", KILL_AT_6)):
        cfg = tiny_config(tmp_path / name, training={**RECIPE, "strategy": strategy})
        run_on_harness(cfg, fault, controller="CommitsFirst")  # 4 committed before the kill
        runs[name] = cfg["checkpoint"]["save_path"]
    assert_resumed_once(runs["killed"])
    assert shard_bytes(runs["killed"], 12) == shard_bytes(runs["clean"], 12)
    clean, killed = step_records(runs["clean"]), step_records(runs["killed"])
    train = Config.from_dict(tiny_config(tmp_path, training=RECIPE)).training
    assert sorted(clean) == list(range(1, 13)) and [clean[s]["lr"] for s in clean] == [
        learning_rate(train, (s - 1) * 16) for s in clean
    ]
    assert max(r["grad_norm"] for r in clean.values()) > RECIPE["grad_clip"]
    assert all(killed[s]["loss"] == clean[s]["loss"] and killed[s]["lr"] == clean[s]["lr"] for s in clean)


def test_after_a_gbs_change_the_curve_goes_on_from_the_same_samples(tmp_path):
    """Saved at step 8 of a gbs-16 run (128 samples), resumed at gbs 32 (step 4, train_steps and warmup
    halved): every resumed step's LR is the one the uninterrupted run used after the same samples."""
    recipe = {**RECIPE, "lr_decay_style": "linear"}
    cfg = tiny_config(tmp_path / "reference", training=recipe)
    run_on_harness(cfg)
    reference = step_records(cfg["checkpoint"]["save_path"])
    loaded = resume_root(cfg["checkpoint"]["save_path"], 8, tmp_path / "old")
    resumed_cfg = tiny_config(
        tmp_path / "resumed",
        training={**recipe, "global_batch_size": 32, "train_steps": 6, "warmup_steps": 1},
        checkpoint={"load_path": loaded},
    )
    resumed_cfg["data"]["path"] = cfg["data"]["path"]
    run_on_harness(resumed_cfg)
    resumed = step_records(resumed_cfg["checkpoint"]["save_path"])
    assert sorted(resumed) == [5, 6]
    # Step 5 at gbs 32 follows 128 samples, like step 9 at gbs 16; step 6 follows 160, like step 11.
    assert resumed[5]["lr"] == reference[9]["lr"] and resumed[6]["lr"] == reference[11]["lr"]
    assert resumed[5]["lr"] < reference[8]["lr"]  # decaying: a jump back would show


def test_the_recipe_under_fsdp_follows_ddp(tmp_path):
    """The same recipe under FSDP2 (sharded gradients: the norm is summed over shards before the clip)
    and under DDP: the same gradient norms and losses to float rounding, step by step."""
    records = {}
    for strategy in ("ddp", "fsdp"):
        cfg = tiny_config(tmp_path / strategy, training={**RECIPE, "strategy": strategy})
        run_on_harness(cfg)
        records[strategy] = step_records(cfg["checkpoint"]["save_path"])
    # Every step of each run was recorded (an empty or partial record would make the loop below vacuous).
    assert sorted(records["ddp"]) == sorted(records["fsdp"]) == list(range(1, FINAL + 1))
    for step, ddp in records["ddp"].items():
        fsdp = records["fsdp"][step]
        assert fsdp["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-4) and fsdp["loss"] == pytest.approx(
            ddp["loss"], rel=1e-4
        ), step


@pytest.mark.invariant(6, 13)
def test_a_resume_into_another_optimizer_is_refused_on_the_driver(tmp_path):
    """AdamW's saved moments would load into SGD without a word from torch: refused before any rank
    starts, naming both; no_load_optim starts the new optimizer from the weights."""
    cfg = tiny_config(tmp_path, training={"train_steps": 4})
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    again = {
        **cfg,
        "training": {**cfg["training"], **RECIPE, "train_steps": 8},
        "checkpoint": {**cfg["checkpoint"], "load_path": root},
    }
    with pytest.raises(CheckpointError) as err:
        harness.run_job(again)
    assert str(err.value) == (
        f"{root}/iteration_00000004/metadata.json: iteration 4 holds the state of optimizer torch.optim.adamw:AdamW, but "
        "training.optimizer builds torch.optim.sgd:SGD; set checkpoint.no_load_optim: true to start torch.optim.sgd:SGD "
        "from its weights, or set training.optimizer back"
    )
    assert (
        json.loads((tmp_path / "ckpt" / "iteration_00000004" / "metadata.json").read_text())["ray_resume"]["optimizer"]
        == "torch.optim.adamw:AdamW"
    )
    # As the message says: weights only, SGD from step 0 (a new save_path), its first loss the loaded weights'.
    losses = {}
    for name, load in (("from-weights", {"load_path": root, "no_load_optim": True}), ("fresh", {})):
        run = {**again, "checkpoint": {**cfg["checkpoint"], **load, "save_path": str(tmp_path / name)}}
        run_on_harness(run)
        [start] = [r for r in read_metrics(str(tmp_path / name)) if r.get("event") == "start" and r["rank"] == 0]
        assert (start["step"], start["source"]) == (0, f"{root}/iteration_00000004" if load else None)
        losses[name] = step_records(str(tmp_path / name))[1]["loss"]
    assert losses["from-weights"] != losses["fresh"]  # the same first batch, other weights


def vector_loss(model, batch):
    """A loss that forgot to reduce: one value per token."""
    logits = model(batch["input_ids"][:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1).long(), reduction="none"
    )


@pytest.mark.invariant(13)
def test_a_loss_that_is_not_a_scalar_ends_the_job_in_one_line_without_a_retry(tmp_path):
    """Found in the ranks, said once in our words, and the group Ray Train restarts for it returns at
    once: only the first attempt starts training, although max_failures would allow two more."""
    cfg = tiny_config(tmp_path)
    outcome = harness.run_job(cfg, loss=vector_loss)
    assert re.fullmatch(
        r"rank [01]: training\.loss returned a torch\.float32 tensor of shape \[64\]; it must return a scalar "
        r"floating-point tensor \(reduce it over the batch, with \.mean\(\) say\)",
        outcome.error,
    ), outcome.error
    assert outcome.attempts == 2 and outcome.committed is None
    started = [r for r in read_metrics(cfg["checkpoint"]["save_path"]) if r.get("event") == "start"]
    assert {r["attempt"] for r in started} == {0}
