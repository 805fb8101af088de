"""End to end on a real Ray cluster: 2 CPU workers over gloo, real files.

The uninterrupted run is the reference. A rank killed under Ray Train must
end with the same shard bytes (invariant 2) and consume the same samples at
every step (invariant 3), resuming by itself from the newest commit. The
other fault phases, FSDP, retention and resharding run on the in-process
harness (tests/test_harness.py), whose runs equal this reference byte for byte.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from conftest import FINAL, read_metrics, tiny_config
from ray_resume.checkpoint.format import paths
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.reader import read_verified, saved_pieces
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.io.storage import LocalStorage
from ray_resume.run import main

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.invariant(4)
def test_uninterrupted_run_commits_every_interval(reference):
    storage = LocalStorage()
    root = reference["root"]
    assert (storage.read_bytes(paths.tracker_path(root))).decode().strip() == str(FINAL)
    # Every interval (4) was saved and committed, and nothing else: each iteration opens as a load opens it.
    assert sorted(p.name for p in Path(root).iterdir() if p.name.startswith("iteration_")) == [
        paths.iteration_dirname(s) for s in (4, 8, FINAL)
    ]
    for step in (4, 8, FINAL):
        saved = open_iteration(storage, root, step)
        assert (saved.common["global_step"], saved.common["consumed_samples"]) == (step, 16 * step)
    assert {r["step"] for r in read_metrics(root) if r.get("saved")} == {4, 8, FINAL}
    it = open_iteration(storage, root, FINAL)
    assert it.common["global_step"] == FINAL and it.common["consumed_samples"] == FINAL * 16
    assert it.common["epoch_num"] == 1 and it.common["step_num"] == 2  # 160 samples = 10 steps per epoch
    read_verified(storage, it, list(it.files))  # sizes and block digests hold
    # Replicated state is split: each tensor element is stored exactly once, by one of the ranks.
    for kind in ("model", "opt"):
        state = load_state(storage, it, kind)
        stored = {}
        for requests in saved_pieces(it, kind).values():
            for r in requests:
                stored[r.piece.name] = stored.get(r.piece.name, 0) + r.piece.numel
        assert stored == {name: t.numel() for name, t in state.items()}
        assert {f.rank for f in it.files.values() if f.kind == kind} == {0, 1}
    # Samples: every step a fresh global batch; the first 10 steps are one full epoch.
    ids = [i for s in range(1, 11) for i in reference["steps"][s][0]["ids"]]
    assert sorted(ids) == list(range(160))


@pytest.mark.invariant(4)
def test_a_failed_commit_ends_the_run_non_zero_naming_it(tmp_path, reference, capsys, caplog):
    """On Ray Train, through the CLI's own main(): the failure reaches the driver, which says which
    iteration and why, and exits 1 (before, it logged "finished" and exited 0)."""
    cfg = tiny_config(tmp_path)
    cfg["data"]["path"] = reference["data"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    with caplog.at_level(logging.INFO, logger="ray_resume"):
        code = main([str(tmp_path / "job.yaml"), "--fault", "phase=commit_fails,step=8"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the workers' lines Ray forwards
    assert code == 1, last
    assert last.startswith("error: training failed: the commit of iteration 8 failed: [Errno 5] injected fault")
    assert "run again with checkpoint.load_path=" in last and "finished:" not in caplog.text


@pytest.mark.invariant(13)
def test_a_user_mistake_a_rank_finds_ends_the_run_once_in_our_words(tmp_path, reference):
    """On Ray Train: a loss that returns one value per token is found by the ranks; the run ends with it
    in our words (main() prints it as `error: ...`, exit 2), and the group Ray Train restarts for it
    trains nothing."""
    from ray import cloudpickle

    import plugin_models
    from ray_resume import train
    from ray_resume.errors import ConfigError

    cloudpickle.register_pickle_by_value(plugin_models)  # the workers cannot import tests/
    try:
        cfg = tiny_config(tmp_path)
        cfg["data"]["path"] = reference["data"]
        with pytest.raises(ConfigError) as err:
            train(cfg, loss=plugin_models.loss_per_token)
    finally:
        cloudpickle.unregister_pickle_by_value(plugin_models)
    assert re.fullmatch(
        r"rank [01]: training\.loss returned a torch\.float32 tensor of shape \[64\]; it must return a "
        r"scalar floating-point tensor \(reduce it over the batch, with \.mean\(\) say\)",
        str(err.value),
    )
    assert err.value.problems == [str(err.value).split(": ", 1)[1]]  # ConfigError's own field, the rank's
    assert "traceback:\nTraceback (most recent call last):" in err.value.__notes__[0]
    assert "in scalar_loss" in err.value.__notes__[0], err.value.__notes__
    started = [r for r in read_metrics(cfg["checkpoint"]["save_path"]) if r.get("event") == "start"]
    assert {r["attempt"] for r in started} == {0}
