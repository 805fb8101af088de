"""`python -m ray_resume.cli`: list / verify / show / export on real roots, and plot of a resumed run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.cli import main
from ray_resume.metrics import read_metrics
from test_checkpoint_format import make_state, write_iteration


@pytest.fixture
def root(tmp_path):
    """Iterations 4 and 8 (tracker) of a 2-rank run, and a half-written 12."""
    model, opt = make_state()
    write_iteration(tmp_path / "ckpt", 2, step=4, model=model, opt=opt)
    write_iteration(tmp_path / "ckpt", 2, step=8, model=model, opt=opt)
    (tmp_path / "ckpt" / paths.iteration_dirname(12)).mkdir()
    return {"root": tmp_path / "ckpt", "model": model, "opt": opt}


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_shows_every_iteration_with_the_tracker(root, capsys):
    code, out, err = cli(capsys, "list", root["root"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["step", "epoch_num", "step_num", "consumed"]
    rows = {int(line.split()[0]): line for line in lines[2:] if line.split() and line.split()[0].isdigit()}
    assert sorted(rows) == [4, 8, 12]
    assert "<- tracker" in rows[8] and "tracker" not in rows[4]
    assert rows[4].split()[-1] == "ok" and "incomplete" in rows[12]
    assert "KiB" in rows[8]  # human-readable size on a terminal

    code, out, _ = cli(capsys, "list", root["root"], "--json")
    data = json.loads(out)
    assert code == 0 and data["tracker"] == 8
    by_step = {r["step"]: r for r in data["iterations"]}
    assert [r["step"] for r in data["iterations"]] == [4, 8, 12]
    assert by_step[8]["tracker"] and by_step[8]["committed"] and not by_step[4]["tracker"]
    assert (
        by_step[4]["consumed_samples"] == 32 and by_step[4]["world_size"] == 2 and by_step[4]["global_batch_size"] == 8
    )
    size = sum(p.stat().st_size for p in (root["root"] / paths.iteration_dirname(8)).iterdir())
    assert by_step[8]["size_bytes"] == size
    assert by_step[12]["status"] == "incomplete" and "common.json" in by_step[12]["error"]


@pytest.mark.invariant(7)
def test_list_verify_marks_a_damaged_iteration(root, capsys):
    code, out, _ = cli(capsys, "list", root["root"], "--verify", "--json")
    assert code == 0
    assert {r["step"]: r["verified"] for r in json.loads(out)["iterations"]} == {4: True, 8: True, 12: None}

    flip_byte(root["root"] / paths.iteration_dirname(4) / "ckpt-opt-0000000-0000002.safetensors")
    code, out, _ = cli(capsys, "list", root["root"], "--verify")
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
    assert rows["4"].rstrip().endswith("NO") and rows["8"].rstrip().endswith("yes")
    assert "ckpt-opt-0000000-0000002.safetensors: xxh3-128 does not match" in out


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.invariant(6, 7)
def test_verify_passes_then_names_the_corrupt_shard(root, capsys):
    code, out, err = cli(capsys, "verify", root["root"])
    assert code == 0, err
    assert "OK: iteration 8 (tracker)" in out

    shard = root["root"] / paths.iteration_dirname(8) / "ckpt-model-0000001-0000002.safetensors"
    flip_byte(shard)
    code, out, err = cli(capsys, "verify", root["root"])
    assert code == 1
    assert f"{shard}: xxh3-128 does not match metadata.json" in out
    assert err.startswith("error: ") and "ckpt-model-0000001-0000002.safetensors" in err and "xxh3-128" in err
    # The other iteration is untouched and still verifies.
    assert cli(capsys, "verify", root["root"], "--iteration", 4)[0] == 0

    code, out, _ = cli(capsys, "verify", root["root"], "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["iteration"] == 8
    assert not report["files"][shard.name]["ok"]
    assert [p for p in report["problems"] if shard.name in p and "xxh3-128" in p]


@pytest.mark.invariant(8)
def test_verify_names_extra_and_missing_shards(root, capsys):
    directory = root["root"] / paths.iteration_dirname(8)
    (directory / "ckpt-model-0000002-0000003.safetensors").write_bytes(b"stale")
    (directory / "ckpt-opt-0000001-0000002.safetensors").unlink()
    code, out, _ = cli(capsys, "verify", root["root"])
    assert code == 1
    assert "ckpt-model-0000002-0000003.safetensors: shard file not listed in metadata.json" in out
    assert "ckpt-opt-0000001-0000002.safetensors: shard listed in metadata.json is missing" in out


def test_show_json_lists_every_tensor_with_its_pieces(root, capsys):
    code, out, err = cli(capsys, "show", root["root"], "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["iteration"] == 8 and shown["common"]["global_step"] == 8 and shown["world_size"] == 2
    storage = LocalStorage()
    it = open_iteration(storage, str(root["root"]), 8)
    expected = {("model", n): t for n, t in root["model"].state_dict().items()}
    expected |= {("opt", n): t for n, t in load_state(storage, it, "opt").items()}
    assert {(t["kind"], t["name"]) for t in shown["tensors"]} == set(expected)
    assert any(kind == "opt" for kind, _ in expected)
    for t in shown["tensors"]:
        tensor = expected[(t["kind"], t["name"])]
        assert t["shape"] == list(tensor.shape) and t["dtype"] == "F32"
        chunks = t["chunks"]  # ranges of whole rows, in order, tiling the tensor
        assert chunks and all(c["file"] in shown["files"] for c in chunks) and t["mindformers_readable"]
        assert sum(c["numel"] for c in chunks) == tensor.numel() and [c["local_shape"][1:] for c in chunks] == [
            list(tensor.shape[1:])
        ] * len(chunks)
        assert [c["start"] for c in chunks] == sorted(c["start"] for c in chunks)

    code, out, _ = cli(capsys, "show", root["root"], "--iteration", 4)
    assert code == 0
    assert "global_step        4" in out and "tok.weight" in out and "ckpt-model-0000000-0000002.safetensors" in out


def test_export_writes_plain_safetensors_equal_to_the_model(root, capsys, tmp_path):
    out_dir = tmp_path / "export"
    (root["root"] / paths.iteration_dirname(8) / paths.CONFIG).write_text("name: from-the-job\n")
    code, out, err = cli(capsys, "export", root["root"], out_dir, "--with-optimizer")
    assert code == 0, err
    loaded = safetensors.torch.load_file(str(out_dir / "model.safetensors"))  # no ray_resume code involved
    expected = root["model"].state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        # bitwise
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    optim = safetensors.torch.load_file(str(out_dir / "optimizer.safetensors"))
    storage = LocalStorage()
    saved_optim = load_state(storage, open_iteration(storage, str(root["root"]), 8), "opt")
    assert optim.keys() == saved_optim.keys() and optim
    for name, tensor in saved_optim.items():
        assert torch.equal(optim[name], tensor), name
    assert (out_dir / "config.yaml").read_text() == "name: from-the-job\n"

    # A fresh model loads the export as its state_dict.
    fresh, _ = make_state(seed=1)
    fresh.load_state_dict(loaded)
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in expected.items())

    # Non-empty output dir: refused, nothing touched; --force overwrites (and drops the stale optimizer file).
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    code, _, err = cli(capsys, "export", root["root"], out_dir, "--iteration", 4)
    assert code == 2 and "not empty" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    code, _, err = cli(capsys, "export", root["root"], out_dir, "--iteration", 4, "--force")
    assert code == 0, err
    # no stale optimizer.safetensors
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.yaml", "model.safetensors"]
    assert (out_dir / "config.yaml").read_text() == "name: test\n"  # iteration 4's, as its commit wrote it


@pytest.mark.invariant(6)
def test_export_refuses_a_corrupt_iteration(root, capsys, tmp_path):
    flip_byte(root["root"] / paths.iteration_dirname(8) / "ckpt-opt-0000001-0000002.safetensors")
    code, _, err = cli(capsys, "export", root["root"], tmp_path / "export")
    assert code == 1 and "ckpt-opt-0000001-0000002.safetensors: xxh3-128 does not match" in err
    assert not (tmp_path / "export").exists()


@pytest.mark.invariant(6)
def test_usage_errors_exit_2_with_one_line(root, capsys, tmp_path):
    for argv, text in [
        (["list", tmp_path / "nowhere"], "does not exist"),
        (["verify", tmp_path / "nowhere"], "does not exist"),
        (["show", root["root"], "--iteration", 5], "no such iteration (iterations here: 4, 8, 12)"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ]:
        code, out, err = cli(capsys, *argv)
        assert code == 2, argv
        assert err.startswith("error: ") and text in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.invariant(6)
def test_a_broken_tracker_is_reported(root, capsys):
    (root["root"] / paths.TRACKER).write_text("abc")
    code, _, err = cli(capsys, "verify", root["root"])
    assert code == 1 and "tracker must hold a non-negative iteration number" in err
    code, _, err = cli(capsys, "list", root["root"])
    assert code == 1 and "tracker must hold" in err


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_of_an_interrupted_and_resumed_run(tmp_path, capsys):
    """The metrics of a real interrupted run (on the in-process harness, a second)."""
    from conftest import KILL_AT_6, run_on_harness, tiny_config

    cfg = tiny_config(tmp_path, checkpoint={"async_save": False})  # 4 is surely committed when rank 1 dies
    run_on_harness(cfg, KILL_AT_6)
    root = cfg["checkpoint"]["save_path"]

    starts = [r for r in read_metrics(root) if r.get("event") == "start"]
    assert any(r["source"] and r["source"].rstrip("/").endswith("iteration_00000004") for r in starts), starts

    out = tmp_path / "loss.png"
    code, text, err = cli(capsys, "plot", root, "-o", out)
    assert code == 0, err
    assert "resumed at step 4 from" in text and "iteration_00000004" in text
    data = out.read_bytes()
    width, height = png_size(data)
    assert width >= 400 and height >= 300
    assert len(data) > 10_000

    # The resumed root is also a well-formed checkpoint for the other commands.
    assert cli(capsys, "verify", root)[0] == 0
