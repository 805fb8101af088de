"""Your own model, loss and data: import paths, signatures, tied weights, the example, the Python API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import KILL_AT_6, REPO, commit_by_hand, run_on_harness, shard_bytes
from ray_resume import parallel, train
from ray_resume.checkpoint.format import state
from ray_resume.checkpoint.loader import load_weights
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.checkpoint.io.writer import save_shards
from ray_resume.config import Config, load_config
from ray_resume.errors import ConfigError
from ray_resume.plugins import make_model, resolve
from examples.tabular_mlp import build, loss, make_data
from plugin_models import TiedLM


def config(**sections) -> Config:
    base = {"name": "p", "checkpoint": {"save_path": "/tmp/unused"}}
    base.update(sections)
    return Config.from_dict(base)


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"model": {"builder": "no_such_pkg.mod:build"}},
            "model.builder: cannot import module 'no_such_pkg.mod' of 'no_such_pkg.mod:build': ModuleNotFoundError",
        ),
        (
            {"model": {"builder": "plugin_models:missing"}},
            "model.builder: module 'plugin_models' has no attribute 'missing'",
        ),
        (
            {"model": {"builder": "plugin_models:NOT_A_FUNCTION"}},
            "model.builder: 'plugin_models:NOT_A_FUNCTION' is a int, not a function",
        ),
        (
            {"training": {"loss": "plugin_models:loss_one_arg"}},
            "training.loss: loss_one_arg must accept (model, batch): too many positional arguments",
        ),
        (
            {"data": {"collate": "examples.tabular_mlp:loss"}},
            "data.collate: loss must accept (arrays): missing a required argument: 'batch'",
        ),
    ],
)
@pytest.mark.invariant(6, 13)
def test_bad_plugins_are_refused_naming_the_key(sections, message):
    with pytest.raises(ConfigError) as err:
        resolve(config(**sections))
    assert message in str(err.value)


@pytest.mark.invariant(6)
def test_malformed_import_path_is_a_config_error():
    with pytest.raises(
        ConfigError, match="model.builder must look like 'package.module:function', got 'pkg.module.fn'"
    ):
        config(model={"builder": "pkg.module.fn"})


@pytest.mark.invariant(13)
def test_fsdp_units_name_module_classes_and_unknown_ones_are_refused_before_any_worker(tmp_path):
    model = make_model(resolve(config()), config())
    assert parallel.fsdp_units(model, []) == list(model.blocks)  # default: each module of an nn.ModuleList
    assert parallel.fsdp_units(model, ["Block", "LayerNorm"]) == [
        m for m in model.modules() if type(m).__name__ in ("Block", "LayerNorm")
    ]
    cfg = config(
        training={"strategy": "fsdp"},
        model={"fsdp_units": ["Blok"]},
        checkpoint={"save_path": str(tmp_path / "ckpt")},
        data={"path": str(tmp_path / "none")},
    )
    with pytest.raises(
        ConfigError, match=r"model.fsdp_units: the model has no module of class 'Blok' \(its classes: .*Block"
    ):
        train(cfg)  # refused on the driver (a meta-device model), before Ray starts
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.invariant(6)
def test_builder_must_return_a_module():
    cfg = config(model={"builder": "plugin_models:build_not_a_module"})
    with pytest.raises(ConfigError, match="model.builder returned str, not a torch.nn.Module"):
        make_model(resolve(cfg), cfg)


@pytest.mark.invariant(2)
def test_tied_weights_are_stored_once_and_restored_tied(tmp_path):
    cfg = config(model={"builder": "plugin_models:build_tied", "args": {"vocab": 16, "width": 8}})
    torch.manual_seed(0)
    model = make_model(resolve(cfg), cfg)
    saved = state.model_tensors(model)
    assert set(saved) == {"embed.weight"}  # head.weight is the same tensor
    storage = LocalStorage()
    manifests = [
        save_shards(
            storage,
            str(tmp_path),
            1,
            prefix="ckpt",
            rank=r,
            world_size=2,
            model_state=saved,
            optim_state=None,
            rank_extras={},
        )
        for r in range(2)
    ]
    commit_by_hand(tmp_path, 1, manifests)
    loaded = load_state(storage, open_iteration(storage, str(tmp_path), 1), "model")
    torch.manual_seed(1)
    fresh = TiedLM(vocab=16, width=8)
    load_weights(fresh, loaded, "here")
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight  # still tied after the load


def test_example_config_validates():
    cfg = load_config(str(REPO / "examples" / "tabular_mlp.yaml"))
    assert cfg.data.columns == {"x": "float32", "y": "float32"} and cfg.model.builder == "examples.tabular_mlp:build"
    plugins = resolve(cfg)
    assert plugins.build_model is build and plugins.loss is loss


def example_config(tmp: Path, data: str, **checkpoint) -> dict:
    cfg = yaml.safe_load((REPO / "examples" / "tabular_mlp.yaml").read_text())
    cfg["data"]["path"] = data
    cfg["training"].update(train_steps=12, log_sample_ids=True)
    cfg["checkpoint"].update(
        save_path=str(tmp / "ckpt"), load_path=str(tmp / "ckpt"), save_interleaved_steps=4, **checkpoint
    )
    return cfg


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    out = tmp_path_factory.mktemp("tabular") / "data"
    make_data(str(out), samples=512)
    return str(out)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.invariant(2)
def test_example_via_python_api_and_its_killed_twin_end_byte_identical(tmp_path, tabular):
    """`ray_resume.train` on Ray Train with the config's import paths; the same job with a rank
    killed, the callables handed over directly, on the in-process harness: the same bytes."""
    clean = example_config(tmp_path / "clean", tabular)
    result = train(clean)
    assert result.committed_iteration == 12
    assert result.checkpoint_path.endswith("iteration_00000012") and result.metrics["step"] == 12
    assert result.metrics["loss"] < 5.0
    killed = example_config(tmp_path / "killed", tabular)
    assert run_on_harness(killed, KILL_AT_6, build_model=build, loss=loss).attempts == 2
    for step in (4, 8, 12):
        assert shard_bytes(tmp_path / "killed" / "ckpt", step) == shard_bytes(tmp_path / "clean" / "ckpt", step)
    names = set(
        load_state(LocalStorage(), open_iteration(LocalStorage(), str(tmp_path / "clean" / "ckpt"), 12), "model")
    )
    assert names == {"0.weight", "0.bias", "3.weight", "3.bias"}  # parameter names from the user's module


@pytest.mark.invariant(2)
def test_batchnorm_statistics_resume_as_the_uninterrupted_run_continues(tmp_path, tabular):
    """Under DDP every rank's running stats differ after a step; the next forward broadcasts rank
    0's. Saved are rank 0's, so a job killed at step 6 ends with the very bytes of its clean twin."""

    def config(where):
        cfg = example_config(where, tabular)
        cfg["model"] = {"builder": "plugin_models:build_batchnorm", "args": {"features": 8, "hidden": 16}}
        return cfg

    run_on_harness(config(tmp_path / "clean"))
    killed = config(tmp_path / "killed")
    assert run_on_harness(killed, KILL_AT_6).attempts == 2
    saved = load_state(LocalStorage(), open_iteration(LocalStorage(), str(tmp_path / "clean" / "ckpt"), 4), "model")
    assert "1.running_mean" in saved and saved["1.running_mean"].abs().sum() > 0
    for step in (8, 12):
        assert shard_bytes(tmp_path / "killed" / "ckpt", step) == shard_bytes(tmp_path / "clean" / "ckpt", step), step


def _buffers_as_saved(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    with torch.no_grad():
        model[1].running_mean.fill_(rank + 1.0)  # each rank's own statistics, as after a step on its own data
    saved = state.with_rank0_buffers(model, state.model_tensors(model), torch.device("cpu"))
    save_file(
        {"saved": saved["1.running_mean"].contiguous(), "live": model[1].running_mean.clone()},
        str(Path(out, f"{rank}.safetensors")),
    )
    dist.barrier()


@pytest.mark.invariant(2)
def test_every_rank_saves_rank_0s_buffers_and_keeps_its_own():
    """What the batchnorm resume rests on: the buffers a save takes are rank 0's on every rank (the ones
    DDP's next forward broadcasts), and the live ones are left as they are."""
    import tempfile
    import uuid

    import harness

    with tempfile.TemporaryDirectory() as out:
        harness.spawn(_buffers_as_saved, (2, f"file://{out}/pg-{uuid.uuid4().hex}", out), 2)
        got = [load_file(str(Path(out, f"{rank}.safetensors"))) for rank in (0, 1)]
    assert [g["saved"].tolist() for g in got] == [[1.0] * 3, [1.0] * 3]
    assert [g["live"].tolist() for g in got] == [[1.0] * 3, [2.0] * 3]
