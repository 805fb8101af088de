"""Resume on another world size (DDP resharding), with another global batch size (scenario C),
and the load_balanced load (scenario D), as whole jobs on the in-process harness (real gloo
ranks, no Ray; tests/test_harness.py shows its runs equal Ray Train's byte for byte).
Growing and shrinking under Ray Train itself is tests/test_elastic_cluster.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import harness
from conftest import per_step, read_metrics, run_on_harness, tiny_config
from ray_resume.checkpoint.format import paths
from ray_resume.errors import CheckpointError


def resume_root(src_root: str, step: int, dest: Path) -> str:
    """A checkpoint root holding only iteration `step` of `src_root`, its tracker naming it."""
    dest.mkdir(parents=True)
    shutil.copytree(paths.iteration_dir(src_root, step), dest / paths.iteration_dirname(step))
    (dest / paths.TRACKER).write_text(f"{step}\n")
    return str(dest)


def starts(root):
    return [r for r in read_metrics(root) if r.get("event") == "start"]


@pytest.fixture(scope="module")
def reference24(tmp_path_factory, local_reference):
    """Uninterrupted 2-worker run at global batch 24 (divisible by 1, 2 and 3 workers x 4), no dropout."""
    tmp = tmp_path_factory.mktemp("reference24")
    cfg = tiny_config(tmp, model={"dropout": 0.0}, training={"global_batch_size": 24})
    cfg["data"]["path"] = local_reference["data"]
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    return {"root": root, "steps": per_step(read_metrics(root)), "data": local_reference["data"]}


@pytest.mark.parametrize("workers, balanced", [(1, False), (3, True)])
@pytest.mark.invariant(3)
def test_resume_on_another_world_size(tmp_path, reference24, workers, balanced):
    root = resume_root(reference24["root"], 4, tmp_path / "ckpt")
    cfg = tiny_config(
        tmp_path,
        model={"dropout": 0.0},
        training={"global_batch_size": 24},
        scaling={"num_workers": workers},
        checkpoint={"load_path": root, "load_balanced": balanced},
    )
    cfg["data"]["path"] = reference24["data"]
    run_on_harness(cfg)
    begun = starts(root)
    assert {(r["step"], r["world_size"], r["consumed_samples"]) for r in begun} == {(4, workers, 96)}
    # The whole saved state is read: once in total with load_balanced, once per rank without.
    stored = sum(p.stat().st_size for p in Path(paths.iteration_dir(root, 4)).glob("*.safetensors"))
    assert sum(r["bytes_read"] for r in begun) == (stored if balanced else stored * workers)
    steps = per_step(read_metrics(root))
    assert sorted(steps) == list(range(5, 13))
    for step, runs in steps.items():
        expected = reference24["steps"][step][0]
        assert runs[-1]["ids"] == expected["ids"], f"step {step}: other samples than the 2-worker run"
        # Exact bits cannot survive a new world size: the gradient all-reduce sums
        # over other partitions in another order. 1e-4 relative is far above that
        # rounding and far below any real divergence (the loss moves ~1e-2 a step).
        assert runs[-1]["loss"] == pytest.approx(expected["loss"], rel=1e-4), step


@pytest.mark.parametrize("new_gbs, final, saved_step, resume_step", [(32, 6, 8, 4), (24, 7, 8, 5)])
@pytest.mark.invariant(3, 10)
def test_changed_global_batch_size_keeps_consumed_samples(
    tmp_path, local_reference, new_gbs, final, saved_step, resume_step
):
    """Spec 1.4: 8 steps at gbs 16 = 128 samples -> step 4 at gbs 32; at gbs 24, 128/24 = 5.33 -> step 5, cursor 128."""
    loaded = resume_root(local_reference["root"], saved_step, tmp_path / "old")
    cfg = tiny_config(
        tmp_path, training={"global_batch_size": new_gbs, "train_steps": final}, checkpoint={"load_path": loaded}
    )
    cfg["data"]["path"] = local_reference["data"]
    with pytest.raises(CheckpointError) as err:  # the rescaled steps would overwrite the run being resumed
        harness.run_job({**cfg, "checkpoint": {**cfg["checkpoint"], "save_path": loaded}})
    assert f"resumes iteration {saved_step} at step {resume_step}" in str(err.value)
    assert "set checkpoint.save_path to a new directory" in str(err.value)
    run_on_harness(cfg)
    root = cfg["checkpoint"]["save_path"]
    begun = starts(root)
    assert {(r["step"], r["consumed_samples"]) for r in begun} == {(resume_step, 128)}
    steps = per_step(read_metrics(root))
    assert sorted(steps) == list(range(resume_step + 1, final + 1))
    consumed_after = 128 + (final - resume_step) * new_gbs
    old_ids = [
        i for s in range(saved_step + 1, consumed_after // 16 + 1) for i in local_reference["steps"][s][0]["ids"]
    ]
    new_ids = [i for s in steps for i in steps[s][-1]["ids"]]
    # Exactly the samples the old run took next, as a multiset (ids recur across the
    # epoch boundary at 160, as they do in the reference run): none repeated, none skipped.
    assert len(new_ids) == consumed_after - 128
    assert sorted(new_ids) == sorted(old_ids)
    common = json.loads((Path(paths.iteration_dir(root, final)) / "common.json").read_text())
    assert (common["consumed_samples"], common["global_batch_size"]) == (consumed_after, new_gbs)
