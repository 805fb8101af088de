"""The seed's system agrees (invariant 14), proven with MindSpore Transformers' own code.

MindFormers 2.1.0's loader (`get_checkpoint_path`, `CommonInfo.load_common`, `load_checkpoint`)
opens what a ray_resume job commits, under DDP and FSDP2, and loads exactly its weights and Adam
moments; and ray_resume resumes roots MindFormers' own `save_checkpoint` wrote (one card, without
metadata.json) and its own `save_metadata` described (two cards): at their step, weights only,
on another global batch size. MindFormers runs in a process of its own (tests/mindformers_side.py);
the model on both sides is the same two Dense layers (tests/plugin_models.py: TwoDense).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import harness
from conftest import env_for_subprocess, read_metrics, run_on_harness, tiny_config
from examples.tabular_mlp import make_data
from plugin_models import TwoDense
from ray_resume import cli
from ray_resume.checkpoint.format import names
from ray_resume.checkpoint.checkpointer import Checkpointer
from ray_resume.checkpoint.root import CommittedIteration
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.errors import CheckpointError
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.config import Config
from ray_resume.optim import MainParamsOptimizer

pytestmark = pytest.mark.invariant(14)
SIDE = Path(__file__).resolve().parent / "mindformers_side.py"
MODEL = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
MOMENTS = tuple(f"{m}.{p}" for m in ("adam_m", "adam_v") for p in MODEL)


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> str:
    """256 samples of 64 features and a target, the input of the two Dense layers."""
    path = str(tmp_path_factory.mktemp("tabular") / "data")
    make_data(path, samples=256, features=64)
    return path


def dense_config(tmp: Path, data: str, *, checkpoint: dict | None = None, **training) -> dict:
    return tiny_config(
        tmp,
        model={"builder": "plugin_models:build_two_dense", "args": {"features": 64, "hidden": 512}},
        data={"path": data, "columns": {"x": "float32", "y": "float32"}, "synthetic": None},
        training={
            "loss": "examples.tabular_mlp:loss",
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "train_steps": 6,
            "log_every": 3,
            **training,
        },
        checkpoint={"save_interleaved_steps": 3, **(checkpoint or {})},
    )


def mindformers(*args: str, cwd: Path) -> tuple[dict, dict]:
    """Run MindFormers' side; what it held or loaded (name -> array), and its JSON report (if any)."""
    cwd.mkdir(parents=True, exist_ok=True)  # MindFormers logs into ./output
    proc = subprocess.run(
        [sys.executable, str(SIDE), *map(str, args)],
        cwd=cwd,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = Path(args[2])
    report = json.loads(Path(f"{out}.json").read_text()) if Path(f"{out}.json").exists() else {}
    return load_file(f"{out}.safetensors"), report


def starts(root: str) -> list[dict]:
    return [r for r in read_metrics(root) if r.get("event") == "start" and r["rank"] == 0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mindformers_loads_exactly_the_weights_and_moments_ray_resume_commits(tmp_path, tabular, strategy):
    cfg = dense_config(tmp_path, tabular, strategy=strategy)
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    storage = LocalStorage()
    it = open_iteration(storage, root, 6)
    # fc1's weight (128 KiB) is cut in two halves of rows on the two ranks under either strategy: MindFormers
    # places them by the Layout metadata.json gives them, not as one whole tensor.
    assert [piece.numel for _, piece in it.tensors["model"]["fc1.weight"].pieces] == [256 * 64, 256 * 64]
    saved = {**load_state(storage, it, "model"), **load_state(storage, it, "opt")}
    loaded, report = mindformers("load", root, tmp_path / "loaded", cwd=tmp_path / "mf")
    assert report == {"path": it.path, "common": it.common}  # the tracker's iteration, CommonInfo(**common.json)
    assert set(MODEL + MOMENTS) <= set(loaded) and set(MODEL + MOMENTS) <= set(saved)
    for name in MODEL + MOMENTS:
        assert np.array_equal(loaded[name], saved[name].numpy()), name
    assert loaded["global_step"].tolist() == [6]  # from common.json, as load_checkpoint takes it
    if strategy == "ddp":  # weights only (no_load_optim in MindFormers' words): the optimizer files are not asked for
        weights, _ = mindformers("load", root, tmp_path / "weights", "--weights-only", cwd=tmp_path / "mf")
        assert all(np.array_equal(weights[name], saved[name].numpy()) for name in MODEL)


@pytest.mark.parametrize("cards", ["save", "save-cards"], ids=["one-card-no-metadata", "two-cards-metadata"])
def test_ray_resume_resumes_what_mindformers_saves(tmp_path, tabular, cards, capsys):
    root = tmp_path / "mindformers"
    truth, _ = mindformers(cards, root, tmp_path / "truth", "--steps", 3, "--gbs", 8, cwd=tmp_path / "mf")
    it = open_iteration(LocalStorage(), str(root), 3)
    assert (it.origin, it.world_size, it.common["consumed_samples"]) == ("mindformers", 1 if cards == "save" else 2, 24)

    # What a rank restores: the weights and moments MindSpore held, its step count each parameter's.
    torch.manual_seed(0)
    model = TwoDense()
    optimizer = MainParamsOptimizer(model, lr=1e-3)
    cfg = Config.from_dict(dense_config(tmp_path / "restore", tabular))
    point, _ = Checkpointer(cfg.checkpoint, None, 0, 1, 0, None).restore(
        model, optimizer, CommittedIteration(str(root), 3), full=True, global_batch_size=8
    )
    assert (point.step, point.consumed_samples, point.source) == (3, 24, it.path)
    for name, tensor in model.state_dict().items():
        assert np.array_equal(tensor.numpy(), truth[name]), name
    for name, param in model.named_parameters():
        slots = optimizer.optimizer.state[param]
        assert np.array_equal(slots["exp_avg"].numpy(), truth[f"adam_m.{name}"]) and np.array_equal(
            slots["exp_avg_sq"].numpy(), truth[f"adam_v.{name}"]
        )
        assert slots["step"].item() == 3.0

    # The CLI reads it, and says what it cannot check.
    assert cli.main(["verify", str(root)]) == 0
    assert "written by MindFormers: sizes and safetensors headers match" in capsys.readouterr().out
    assert cli.main(["show", str(root)]) == 0 and "adam_m.fc1.weight" in capsys.readouterr().out

    # Whole jobs: a full resume at its step, weights only from step 0, another global batch size rescaled.
    for label, checkpoint, training, step in (
        ("full", {}, {}, 3),
        ("weights", {"no_load_optim": True}, {"train_steps": 3}, 0),
        ("rescaled", {}, {"global_batch_size": 4, "micro_batch_size": 2, "train_steps": 8}, 6),
    ):
        cfg = dense_config(tmp_path / label, tabular, checkpoint={"load_path": str(root), **checkpoint}, **training)
        run_on_harness(cfg)
        [first] = starts(cfg["checkpoint"]["save_path"])
        assert (first["step"], first["source"], first["consumed_samples"]) == (step, it.path, 24 if step else 0), label


def test_what_cannot_map_is_refused_on_the_driver_and_an_abnormal_iteration_passed_over(tmp_path, tabular):
    root = tmp_path / "mindformers"
    mindformers("save", root, tmp_path / "truth", "--steps", 3, "--gbs", 8, cwd=tmp_path / "mf")
    where = f"{root}/iteration_00000003/metadata.json"
    misfit = dense_config(tmp_path / "misfit", tabular, checkpoint={"load_path": str(root)})
    misfit["model"]["args"]["hidden"] = 256
    with pytest.raises(
        CheckpointError,
        match=rf"^{where}: tensor 'fc1.weight' is torch.float32 \[512, 64\] there but torch.float32 "
        r"\[256, 64\] in the model",
    ):
        harness.run_job(misfit)
    sgd = dense_config(
        tmp_path / "sgd",
        tabular,
        checkpoint={"load_path": str(root)},
        optimizer="torch.optim.SGD",
        optimizer_args={"momentum": 0.9},
    )
    with pytest.raises(
        CheckpointError,
        match=rf"^{where}: iteration 3 holds optimizer state 'adam_m.fc1.bias' \(torch's 'exp_avg'\), but "
        r"training.optimizer builds torch.optim.sgd:SGD, which keeps \['momentum_buffer'\]; "
        "set checkpoint.no_load_optim: true",
    ):
        harness.run_job(sgd)

    # An iteration MindFormers marked abnormal (ckpt_status 1) is passed over for the healthy one, as its
    # own loader does, and left where it is.
    newer = root / "iteration_00000005"
    shutil.copytree(root / "iteration_00000003", newer)
    common = json.loads((newer / "common.json").read_text())
    (newer / "common.json").chmod(0o644)
    (newer / "common.json").write_text(json.dumps({**common, "global_step": 5, "ckpt_status": 1}))
    (root / "latest_checkpointed_iteration.txt").chmod(0o644)
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    cfg = dense_config(tmp_path / "resumed", tabular, checkpoint={"load_path": str(root)})
    run_on_harness(cfg)
    assert starts(cfg["checkpoint"]["save_path"])[0]["source"] == str(root / "iteration_00000003")
    assert newer.is_dir() and not list(root.glob("*.damaged-*"))
    assert names.parse_state_name("adam_m.fc1.bias") == ("fc1.bias", "exp_avg")
