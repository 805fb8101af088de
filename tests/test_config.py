"""Tests for ray_resume.config: strict, collecting validation with exact messages."""

from __future__ import annotations

import copy
import glob
import os
import re

import pytest

from ray_resume.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    ScalingConfig,
    SyntheticDataConfig,
    TrainingConfig,
    apply_overrides,
    load_config,
)
from ray_resume.ray_backend import scaling_config
from ray_resume.faults import Fault

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))

BASE = {
    "name": "t",
    "training": {"global_batch_size": 32, "micro_batch_size": 8},
    "scaling": {"num_workers": 2},
    "checkpoint": {"save_path": "./out"},
}


def cfg(**sections) -> dict:
    """BASE with sections deep-merged in (a value of None replaces the section)."""
    d = copy.deepcopy(BASE)
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k].update(v)
        else:
            d[k] = v
    return d


def problems(d: dict, source: str = "x.yaml") -> list[str]:
    with pytest.raises(ConfigError) as ei:
        Config.from_dict(d, source=source)
    return ei.value.problems


def write(tmp_path, text: str, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ----------------------------------------------------------------- happy path / defaults
def test_minimal_config_uses_defaults():
    c = Config.from_dict({"name": "n", "checkpoint": {"save_path": "s"}})
    assert c.model.vocab_size == 256 and c.model.dtype == "float32"
    assert c.training.lr == 3.0e-4 and c.training.strategy == "ddp"
    assert c.scaling.num_workers == 2 and c.scaling.world_sizes == [2]
    assert c.failure.max_failures == 3
    assert c.data.synthetic is None


def test_checkpoint_defaults_match_spec():
    ck = CheckpointConfig(save_path="x")
    assert (ck.enable_save, ck.save_interleaved_steps, ck.no_save_optim, ck.save_max) == (True, 1000, False, 5)
    assert (ck.load_path, ck.no_load_optim, ck.load_balanced) == ("", False, False)
    # save_path defaults to "" (which is only legal with enable_save false)
    ck2 = CheckpointConfig(enable_save=False)
    assert ck2.save_path == ""


def test_world_sizes_and_accumulation():
    s = ScalingConfig(num_workers=[1, 3])
    assert s.world_sizes == [1, 2, 3] and s.max_workers == 3
    assert TrainingConfig(global_batch_size=48, micro_batch_size=8).accumulation_steps(3) == 2


def test_int_accepted_for_float_and_round_trip():
    c = Config.from_dict(cfg(training={"lr": 1}, scaling={"num_workers": [1, 2]}, data={"synthetic": {"samples": 10}}))
    assert c.training.lr == 1.0 and isinstance(c.training.lr, float)
    d = c.to_dict()
    assert d["scaling"]["num_workers"] == [1, 2] and d["data"]["synthetic"]["samples"] == 10
    assert Config.from_dict(d) == c
    assert Config.from_dict(d).to_dict() == d


# ----------------------------------------------------------------- unknown keys / types
@pytest.mark.invariant(6, 13)
def test_unknown_top_level_key_did_you_mean():
    assert problems(cfg(trainig={"lr": 1})) == ["x.yaml: trainig: unknown key; did you mean 'training'?"]


@pytest.mark.invariant(6, 13)
def test_unknown_nested_key_did_you_mean():
    assert problems(cfg(checkpoint={"save_maxx": 3})) == [
        "x.yaml: checkpoint.save_maxx: unknown key; did you mean 'save_max'?"
    ]
    assert problems(cfg(data={"synthetic": {"sampels": 3}})) == [
        "x.yaml: data.synthetic.sampels: unknown key; did you mean 'samples'?"
    ]


@pytest.mark.invariant(6, 13)
def test_wrong_type_names_full_key():
    assert problems(cfg(training={"lr": "abc"})) == ["x.yaml: training.lr must be a number, got str 'abc'"]
    assert problems(cfg(checkpoint={"save_max": True})) == [
        "x.yaml: checkpoint.save_max must be an integer, got bool True"
    ]
    assert problems(cfg(model="big")) == ["x.yaml: model must be a mapping, got str 'big'"]
    assert problems(cfg(scaling={"num_workers": "2"})) == [
        "x.yaml: scaling.num_workers must be an integer or a list of integers, got str '2'"
    ]
    assert problems(cfg(failure={"fork_server": "maybe"})) == [
        "x.yaml: failure.fork_server must be true, false or auto, got str 'maybe'"
    ]


def test_a_config_saved_with_the_fork_server_key_still_runs_and_says_the_key_is_retired(tmp_path, caplog):
    """Every config.yaml saved before the fork server went holds failure.fork_server (auto, its
    default): it loads, the driver says once that the key does nothing, and no new save holds it."""
    import yaml

    import harness
    from conftest import tiny_config

    d = tiny_config(tmp_path, training={"train_steps": 4})
    d["failure"] = {**d.get("failure", {}), "fork_server": "auto"}
    with caplog.at_level("WARNING", logger="ray_resume"):
        outcome = harness.run_job(d)
    assert outcome.committed == 4
    assert [r.getMessage() for r in caplog.records if "fork_server" in r.getMessage()] == [
        "[tiny] failure.fork_server: auto is no longer used: restarted ranks are new processes Ray starts "
        "(docs/restarts.md); remove the key"
    ]
    saved = yaml.safe_load((tmp_path / "ckpt" / "iteration_00000004" / "config.yaml").read_text())
    assert "fork_server" not in saved["failure"]


@pytest.mark.invariant(6, 13)
def test_evaluation_needs_a_held_out_dataset():
    assert problems(cfg(training={"eval_every": 50})) == [
        "x.yaml: training.eval_every=50 needs data.eval_path (a held-out dataset); set it, or eval_every: 0"
    ]
    assert problems(cfg(training={"eval_every": -1})) == ["x.yaml: training.eval_every must be >= 0, got -1"]


def test_a_wrong_credential_is_named_but_never_shown():
    assert problems(
        cfg(checkpoint={"save_path": "/x", "storage": {"secret_access_key": 1234567, "session_token": ["tok-123"]}})
    ) == [
        "x.yaml: checkpoint.storage.secret_access_key must be a string, got int <redacted>",
        "x.yaml: checkpoint.storage.session_token must be a string, got list <redacted>",
    ]


@pytest.mark.invariant(6, 13)
def test_worker_resources_and_resize_interval_are_checked():
    c = Config.from_dict(
        cfg(
            scaling={
                "num_workers": [1, 2],
                "resources_per_worker": {"CPU": 2, "train_slot": 1},
                "elastic_resize_interval_s": 5,
            }
        )
    )
    assert (
        c.scaling.resources_per_worker == {"CPU": 2.0, "train_slot": 1.0} and c.scaling.elastic_resize_interval_s == 5.0
    )
    ray_side = scaling_config(c.scaling)  # what run.py hands to TorchTrainer
    assert (ray_side.num_workers, ray_side.resources_per_worker, ray_side.elastic_resize_monitor_interval_s) == (
        (1, 2),
        {"CPU": 2.0, "train_slot": 1.0},
        5.0,
    )
    default = scaling_config(Config.from_dict(cfg()).scaling)
    # Ray's default: 1 CPU
    assert (default.num_workers, default.resources_per_worker, default.num_cpus_per_worker) == (2, None, 1)
    assert problems(cfg(scaling={"resources_per_worker": {"CPU": -1}, "elastic_resize_interval_s": 0})) == [
        "x.yaml: scaling.resources_per_worker.CPU must be >= 0, got -1",
        "x.yaml: scaling.elastic_resize_interval_s must be > 0, got 0",
    ]
    assert problems(cfg(scaling={"resources_per_worker": {"GPU": "one"}})) == [
        "x.yaml: scaling.resources_per_worker.GPU must be a number, got str 'one'"
    ]
    assert problems(cfg(scaling={"resources_per_worker": [1]})) == [
        "x.yaml: scaling.resources_per_worker must be a mapping, got list [1]"
    ]


@pytest.mark.invariant(6, 13)
def test_required_keys():
    assert problems({}) == [
        "x.yaml: name is required (a string)",
        "x.yaml: checkpoint.save_path must be set when checkpoint.enable_save is true",
    ]


# ----------------------------------------------------------------- impossible values
@pytest.mark.parametrize("value", [0, -5])
@pytest.mark.invariant(6, 13)
def test_save_interleaved_steps_must_be_positive(value):
    assert problems(cfg(checkpoint={"save_interleaved_steps": value})) == [
        f"x.yaml: checkpoint.save_interleaved_steps must be >= 1, got {value}"
    ]


@pytest.mark.invariant(6, 13)
def test_save_max_zero():
    assert problems(cfg(checkpoint={"save_max": 0})) == ["x.yaml: checkpoint.save_max must be >= 1, got 0"]


@pytest.mark.invariant(6, 13)
def test_global_batch_not_divisible():
    assert problems(cfg(training={"global_batch_size": 30})) == [
        "x.yaml: training.global_batch_size=30 is not divisible by scaling.num_workers (2) x "
        "training.micro_batch_size (8) = 16; choose a global_batch_size that is a multiple of 16 "
        "(gradient accumulation makes up the rest)"
    ]


@pytest.mark.invariant(6, 13)
def test_elastic_range_names_failing_world_size():
    (msg,) = problems(cfg(scaling={"num_workers": [1, 3]}))
    assert msg == (
        "x.yaml: training.global_batch_size=32 is not divisible by world size x training.micro_batch_size "
        "for world sizes [3] of elastic scaling.num_workers=[1, 3] (3 x 8 = 24); choose a global_batch_size "
        "that is a multiple of 48 (gradient accumulation makes up the rest)"
    )


@pytest.mark.invariant(6, 13)
def test_bad_scaling_range():
    assert problems(cfg(scaling={"num_workers": [3, 1]})) == [
        "x.yaml: scaling.num_workers [min, max] needs min <= max, got [3, 1]"
    ]
    assert problems(cfg(scaling={"num_workers": 0})) == ["x.yaml: scaling.num_workers must be >= 1, got 0"]


@pytest.mark.invariant(6, 13)
def test_bad_enums():
    assert problems(cfg(model={"dtype": "float64"})) == [
        "x.yaml: model.dtype must be one of float32, bfloat16, float16; got 'float64'"
    ]
    assert problems(cfg(training={"strategy": "zero3"})) == [
        "x.yaml: training.strategy must be one of ddp, fsdp; got 'zero3'"
    ]
    assert problems(cfg(checkpoint={"save_path": "/tmp/c", "checksum": "md5"})) == [
        "x.yaml: checkpoint.checksum must be one of xxh3-128, sha256; got 'md5'"
    ]


def test_a_key_that_takes_auto_says_what_else_it_takes_in_one_line():
    assert problems(cfg(checkpoint={"save_path": "/tmp/c", "async_save": "yes"})) == [
        "x.yaml: checkpoint.async_save must be true, false or auto, got str 'yes'"
    ]
    assert problems(cfg(checkpoint={"save_path": "/tmp/c", "memory_interleaved_steps": -1})) == [
        "x.yaml: checkpoint.memory_interleaved_steps must be an integer >= 0 or auto, got int -1"
    ]
    for value in (True, False, "auto"):
        assert (
            Config.from_dict(cfg(checkpoint={"save_path": "/tmp/c", "async_save": value})).checkpoint.async_save
            is value
        )


@pytest.mark.invariant(6, 13)
def test_enable_save_requires_save_path():
    assert problems(cfg(checkpoint={"save_path": ""})) == [
        "x.yaml: checkpoint.save_path must be set when checkpoint.enable_save is true"
    ]
    Config.from_dict(cfg(checkpoint={"save_path": "", "enable_save": False}))


@pytest.mark.invariant(6, 13)
def test_model_and_name_checks():
    assert problems(cfg(model={"n_heads": 3})) == ["x.yaml: model.d_model (128) must be divisible by model.n_heads (3)"]
    assert problems(cfg(name="a/b")) == ["x.yaml: name must be non-empty and use only [A-Za-z0-9._-], got 'a/b'"]
    assert problems(cfg(failure={"max_failures": -2})) == ["x.yaml: failure.max_failures must be >= -1, got -2"]


@pytest.mark.invariant(6, 13)
def test_many_problems_reported_together():
    d = cfg(
        checkpoint={"save_max": 0, "save_maxx": 1},
        training={"lr": "abc", "global_batch_size": 30},
        model={"dtype": "fp8"},
        bogus=1,
    )
    with pytest.raises(ConfigError) as ei:
        Config.from_dict(d, source="configs/x.yaml")
    got = ei.value.problems
    assert sorted(got) == sorted(
        [
            "configs/x.yaml: bogus: unknown key (known keys: name, model, data, training, scaling, failure, "
            "checkpoint)",
            "configs/x.yaml: model.dtype must be one of float32, bfloat16, float16; got 'fp8'",
            "configs/x.yaml: training.lr must be a number, got str 'abc'",
            "configs/x.yaml: checkpoint.save_maxx: unknown key; did you mean 'save_max'?",
            "configs/x.yaml: checkpoint.save_max must be >= 1, got 0",
            "configs/x.yaml: training.global_batch_size=30 is not divisible by scaling.num_workers (2) x "
            "training.micro_batch_size (8) = 16; choose a global_batch_size that is a multiple of 16 "
            "(gradient accumulation makes up the rest)",
        ]
    )
    text = str(ei.value)
    assert text.startswith("6 config problems:\n")
    assert all(p in text for p in got)


@pytest.mark.invariant(6, 13)
def test_type_error_suppresses_follow_on_problems():
    # a bad micro_batch_size must not also produce a divisibility complaint about the default
    assert problems(cfg(training={"micro_batch_size": "8"})) == [
        "x.yaml: training.micro_batch_size must be an integer, got str '8'"
    ]


@pytest.mark.invariant(6, 13)
def test_direct_construction_validates():
    with pytest.raises(ConfigError, match=r"checkpoint.save_max must be >= 1, got 0"):
        CheckpointConfig(save_path="x", save_max=0)
    with pytest.raises(ConfigError, match=r"data.synthetic.samples must be >= 1, got 0"):
        SyntheticDataConfig(samples=0)


# ----------------------------------------------------------------- files
@pytest.mark.invariant(6, 13)
def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert str(ei.value) == f"{path}: config file not found"


@pytest.mark.invariant(6, 13)
def test_yaml_parse_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "name: x\ntraining:\n  lr: [1, 2\n  seed: 3\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: invalid YAML at line 4, column 7: ")


@pytest.mark.invariant(6, 13)
def test_top_level_not_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"c\.yaml: top level must be a mapping, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"c\.yaml: top level must be a mapping, got NoneType"):
        load_config(write(tmp_path, ""))


@pytest.mark.invariant(6, 13)
def test_load_config_errors_name_source(tmp_path):
    path = write(tmp_path, "name: x\ncheckpoint: {save_path: s, save_max: 0}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert str(ei.value) == f"{path}: checkpoint.save_max must be >= 1, got 0"


# ----------------------------------------------------------------- an injected fault
@pytest.mark.invariant(6, 13)
def test_a_fault_is_injected_never_configured(tmp_path, capsys, monkeypatch):
    """`--fault` (a drill) names a phase, a step and a rank; a mistake in it is one line, exit 2, before
    Ray starts; and a config file has no fault section at all."""
    import ray_resume.ray_backend
    from ray_resume import run

    assert Fault.parse("phase=after_optimizer_step,step=90,rank=1") == Fault("after_optimizer_step", 90, 1)
    assert Fault.parse("step=8,phase=commit_fails") == Fault("commit_fails", 8, 0)
    assert problems(cfg(fault={"phase": "before_report", "step": 3}))[0].startswith("x.yaml: fault: unknown key")
    path = write(tmp_path, "name: x\nscaling: {num_workers: 2}\ncheckpoint: {save_path: %s}\n" % (tmp_path / "ck"))
    started = []
    monkeypatch.setattr(ray_resume.ray_backend, "init_ray", lambda *args: started.append(args))
    for fault, says in [
        ("phase=sometime,step=5", "fault phase 'sometime' is not one of after_optimizer_step, mid_shard_write, "),
        ("phase=before_report,step=0", "fault step must be an integer >= 1, got 0"),
        ("phase=before_report,step=x", "--fault 'phase=before_report,step=x': step and rank are integers"),
        (
            "phase=before_report,at=3",
            "--fault 'phase=before_report,at=3': write phase=PHASE,step=STEP[,rank=RANK] (at ",
        ),
        ("phase=before_report,step=1,rank=2", "fault rank 2 must be < the largest world size scaling.num_workers (2)"),
    ]:
        assert run.main([path, "--fault", fault]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: " + says), line
    assert started == []


# ----------------------------------------------------------------- overrides
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")


def test_overrides_parse_values_as_yaml():
    c = load_config(
        QUICK,
        [
            "training.train_steps=20",
            'checkpoint.load_path=""',
            "scaling.num_workers=[1,2]",
            "training.lr=1e-3",
            "checkpoint.save_path=./o/ck",
        ],
    )
    assert c.training.train_steps == 20
    assert c.checkpoint.load_path == ""
    assert c.scaling.num_workers == [1, 2] and c.scaling.world_sizes == [1, 2]
    assert c.training.lr == 1e-3
    assert c.checkpoint.save_path == "./o/ck"


def test_override_creates_optional_block(tmp_path):
    path = write(tmp_path, "name: x\ncheckpoint: {save_path: s}\ndata: {synthetic: null}\n")
    c2 = load_config(path, ["data.synthetic.samples=10"])
    assert c2.data.synthetic.samples == 10 and c2.data.synthetic.files == 4


@pytest.mark.invariant(6, 13)
def test_override_unknown_key():
    with pytest.raises(ConfigError) as ei:
        load_config(QUICK, ["training.train_stpes=5"])
    assert ei.value.problems == [f"{QUICK}: training.train_stpes: unknown key; did you mean 'train_steps'?"]


@pytest.mark.invariant(6, 13)
def test_override_malformed():
    with pytest.raises(ConfigError) as ei:
        load_config(QUICK, ["training.train_steps"])
    assert str(ei.value) == f"{QUICK}: override 'training.train_steps' must look like dotted.key=value"
    with pytest.raises(ConfigError, match=r"training\.lr is not a mapping"):
        apply_overrides({"training": {"lr": 1.0}}, ["training.lr.x=1"])


def test_apply_overrides_does_not_mutate():
    d = {"a": {"b": 1}}
    assert apply_overrides(d, ["a.b=2", "c.d=x"]) == {"a": {"b": 2}, "c": {"d": "x"}}
    assert d == {"a": {"b": 1}}


# ----------------------------------------------------------------- shipped configs
def test_every_config_the_docs_name_is_shipped_and_every_shipped_one_is_named():
    """README.md and docs/ are how users find configs: no dead name there, no undocumented file here
    (and the parametrized check below cannot pass by finding no file at all)."""
    docs = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    named = {name for doc in docs for name in re.findall(r"configs/([\w.-]+\.yaml)", open(doc).read())}
    assert named == {os.path.basename(p) for p in CONFIG_FILES}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_shipped_config_is_valid(path):
    c = load_config(path)
    assert Config.from_dict(c.to_dict()) == c
    for ws in c.scaling.world_sizes:
        assert c.training.accumulation_steps(ws) >= 1


def test_the_readme_quickstart_story_follows_from_its_config():
    """The README shows the quickstart killing a rank and resuming from an earlier iteration, and a
    re-run resuming: its config and its command's drill must make exactly that happen."""
    c = load_config(QUICK)
    readme = open(os.path.join(ROOT, "README.md")).read()
    fault = Fault.parse(re.search(r"ray_resume\.run configs/quickstart\.yaml --fault (\S+)", readme)[1])
    kill = re.search(r"\[fault\] killing rank (\d+) at step (\d+) in phase (\w+)", readme)
    resumed = re.search(r"resumed from \S+/iteration_(\d+) .*: global_step (\d+), consumed samples (\d+)", readme)
    assert (fault.rank, fault.step, fault.phase) == (int(kill[1]), int(kill[2]), kill[3])
    every = c.checkpoint.save_interleaved_steps
    newest_commit = fault.step // every * every
    assert 0 < newest_commit < fault.step < c.training.train_steps  # the kill costs steps, and is redone
    assert int(resumed[1]) == int(resumed[2]) == newest_commit
    assert int(resumed[3]) == newest_commit * c.training.global_batch_size
    assert f"for {c.training.train_steps} steps by {c.scaling.num_workers} Ray workers" in readme
    assert f"saving every {every} steps" in readme
    assert c.checkpoint.load_path == c.checkpoint.save_path  # "Running it again resumes"


def test_scenario_a_is_the_quickstart_resuming_its_own_root():
    """Its comment: the quickstart's model, data and training, saved to and loaded from one root."""
    c = load_config(os.path.join(ROOT, "configs", "scenario_a_resume.yaml"))
    q = load_config(QUICK)
    assert (c.model, c.data, c.training) == (q.model, q.data, q.training)
    assert c.checkpoint.save_path == c.checkpoint.load_path != q.checkpoint.save_path


def test_the_json_schema_takes_every_shipped_config_and_refuses_an_unknown_key():
    """`python -m ray_resume.config schema`: what editors validate a config file with."""
    import json
    import subprocess
    import sys

    import jsonschema
    import yaml

    out = subprocess.run(
        [sys.executable, "-m", "ray_resume.config", "schema"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    schema = json.loads(out.stdout)
    for path in CONFIG_FILES:
        jsonschema.validate(yaml.safe_load(open(path).read()), schema)
    bad = yaml.safe_load(open(QUICK).read())
    bad["checkpoint"]["save_pth"] = "x"
    with pytest.raises(jsonschema.ValidationError, match="'save_pth' was unexpected"):
        jsonschema.validate(bad, schema)
    bad = yaml.safe_load(open(QUICK).read())
    bad["training"]["train_steps"] = "many"
    with pytest.raises(jsonschema.ValidationError, match="'many' is not of type 'integer'"):
        jsonschema.validate(bad, schema)
    checksum = schema["$defs"]["CheckpointConfig"]["properties"]["checksum"]
    assert checksum["default"] == "xxh3-128" and checksum["description"].startswith(
        "digest of each 4 MiB block of a shard"
    )
