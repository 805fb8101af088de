"""Your own Ray Train train_func with ray_resume's checkpointing: ray_resume.fit and get_checkpointer."""

from __future__ import annotations

import os
import random
import signal
import sys

import numpy as np
import pytest
import torch
from ray import cloudpickle

import ray_resume
from conftest import shard_bytes
from ray_resume.checkpoint.loader import load_state
from ray_resume.checkpoint.io.iterations import open_iteration
from ray_resume.checkpoint.io.storage import LocalStorage
from test_elastic import resume_root

STEPS, EVERY, BATCH = 12, 4, 8
DROPOUT_UNTIL = 8  # masks drawn from each rank's own stream up to 8; after it the steps 1 rank can redo for 2


class Counter:
    """A stateful object of the user's, per rank: the samples this rank saw and their running sum."""

    def __init__(self, rank: int):
        self.rank, self.seen, self.total = rank, 0, torch.zeros(6)

    def state_dict(self) -> dict:
        return {"rank": self.rank, "seen": self.seen, "total": self.total.clone(), "shape": (6,)}

    def load_state_dict(self, state: dict) -> None:
        assert state["shape"] == (6,)  # tuples come back as tuples
        self.rank, self.seen, self.total = state["rank"], state["seen"], state["total"].clone()


def train_func(config: dict) -> None:
    """A plain Ray Train loop: DDP via prepare_model, SGD with momentum, a cosine schedule, dropout
    until DROPOUT_UNTIL, a global batch that is a pure function of the step, sliced by rank."""
    import ray.train
    import ray.train.torch

    ck = ray_resume.get_checkpointer()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    dropout = torch.nn.Dropout(0.2)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), dropout, torch.nn.Linear(32, 3))
    model = ray.train.torch.prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.01)
    counter = Counter(rank)
    start = ck.restore(model, opt, extra={"sched": sched, "counter": counter})
    if start.source is None:  # each rank's streams (torch's draws the dropout masks); a resume restores them
        torch.manual_seed(100 + rank)
        np.random.seed(100 + rank)
        random.seed(100 + rank)
    for step in range(start.step + 1, STEPS + 1):
        dropout.p = 0.2 if step <= DROPOUT_UNTIL else 0.0
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        xs, ys = x[rank::world], y[rank::world]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
        sched.step()
        counter.seen += len(xs)
        counter.total += xs.sum(0)
        if step == config.get("kill_at") and rank == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # after the optimizer step, before this step's save
        ck.maybe_save(step, consumed_samples=step * BATCH, global_batch_size=BATCH)


@pytest.fixture
def by_value():
    """The workers cannot import tests/: train_func and Counter travel by value."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def fit(root, *, workers: int = 2, load=None, **loop):
    """As Ray Train's docs write a run: its ScalingConfig and RunConfig objects, try/except around fit."""
    import ray.train

    try:
        result = ray_resume.fit(
            train_func,
            train_loop_config=loop,
            checkpoint={"save_path": str(root), "load_path": str(load or root), "save_interleaved_steps": EVERY},
            scaling_config=ray.train.ScalingConfig(num_workers=workers),
            run_config=ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=2)),
        )
    except ray.train.TrainingFailedError as exc:
        pytest.fail(f"training failed: {exc}")
    assert result.committed_iteration == STEPS and result.checkpoint.path.endswith(f"iteration_{STEPS:08d}")
    return result


@pytest.mark.usefixtures("ray_cluster", "by_value")
@pytest.mark.invariant(2)
def test_your_train_func_resumes_byte_identical_after_a_worker_sigkill_and_on_another_world_size(tmp_path):
    """Three fits (about 20 s each alone, the most of which is Ray Train starting a worker group): the
    uninterrupted run, its twin with rank 1 SIGKILLed, and a 1-rank resume from the first's iteration 8;
    the first is the reference of both.
    Not smaller: what is proven is a restart by Ray Train itself and a resume on another world size, a fit
    each, and their reference a third."""
    fit(tmp_path / "clean")
    fit(tmp_path / "killed", kill_at=6, marker=str(tmp_path / "killed-once"))
    assert (tmp_path / "killed-once").exists()  # rank 1 was SIGKILLed after step 6 and the group resumed from 4
    for step in (4, 8, STEPS):  # model, optimizer (momentum, the scheduler's lr in the groups), RNG, counters
        assert shard_bytes(tmp_path / "killed", step) == shard_bytes(tmp_path / "clean", step), step

    # From iteration 8 on 1 rank (no dropout after 8: 1 rank cannot draw 2 ranks' masks): the same global
    # batches, so the 2-rank run's weights to float rounding (the gradient mean is summed another way).
    at8 = resume_root(str(tmp_path / "clean"), 8, tmp_path / "at8")
    fit(tmp_path / "on1", workers=1, load=at8)
    weights = {
        run: load_state(LocalStorage(), open_iteration(LocalStorage(), str(tmp_path / run), STEPS), "model")
        for run in ("clean", "on1")
    }
    assert weights["on1"].keys() == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert weights["clean"].keys() == weights["on1"].keys()
    for name, tensor in weights["clean"].items():
        torch.testing.assert_close(weights["on1"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.invariant(6)
def test_extra_state_that_json_and_safetensors_cannot_hold_is_refused_by_key_path():
    from ray_resume.extra_state import dump_extra, load_extra
    from ray_resume.errors import ConfigError

    class Holder:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    g = torch.Generator().manual_seed(3)
    kept = {"h": Holder({"n": 1, "t": torch.arange(3), 2: ["x", None, 1.5, (1, 2)]}), "g": g}
    text = dump_extra(kept)
    expected = torch.randn(2, generator=g)
    back = {"h": Holder(None), "g": torch.Generator().manual_seed(0)}
    load_extra(back, text, where="it")
    assert back["h"].state["n"] == 1 and torch.equal(back["h"].state["t"], torch.arange(3))
    assert back["h"].state[2] == ["x", None, 1.5, (1, 2)]  # int keys and tuples survive JSON
    assert torch.equal(torch.randn(2, generator=back["g"]), expected)  # the generator's stream goes on
    with pytest.raises(ConfigError) as err:
        dump_extra({"h": Holder({"inner": {"when": object()}})})
    assert str(err.value) == (
        "extra['h']['inner']['when'] is a object; extra state may hold tensors, numbers, strings, bools, "
        "None, and lists, tuples and dicts of them (no pickle)"
    )


@pytest.mark.invariant(6, 13)
def test_bad_keys_are_refused_before_ray_starts_and_the_checkpointer_lives_only_in_fit():
    from ray_resume.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        ray_resume.fit(train_func, checkpoint={"save_pth": "/tmp/x"}, scaling_config={"num_workers": 2})
    assert err.value.problems[0] == "ray_resume.fit: checkpoint.save_pth: unknown key; did you mean 'save_path'?"
    with pytest.raises(RuntimeError, match=r"works inside a train_func run by ray_resume.fit\(\)"):
        ray_resume.get_checkpointer()


@pytest.mark.invariant(6, 13)
def test_extra_state_with_no_save_optim_is_refused_before_anything_loads(tmp_path):
    """It rides in the optimizer shards: with no_save_optim it would vanish at the first restart, silently."""
    from ray_resume.checkpoint.root import ResumePlan
    from ray_resume.controller.job import AttemptStart
    from ray_resume.rank import RankCheckpointer, RankJob
    from ray_resume.config import Config
    from ray_resume.errors import ConfigError

    cfg = Config.from_dict({"name": "x", "checkpoint": {"save_path": str(tmp_path), "no_save_optim": True}})
    ck = RankCheckpointer(
        RankJob(cfg, controller=None, rank=0, world=1, job_id="j", start=AttemptStart(0, ResumePlan()), faults=None)
    )
    model = torch.nn.Linear(2, 2)
    sched = torch.optim.lr_scheduler.StepLR(opt := torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(
        ConfigError, match="extra state rides in the optimizer shards, which checkpoint.no_save_optim: true leaves out"
    ):
        ck.restore(model, opt, extra={"sched": sched})


def raises_on_rank_1(config: dict) -> None:
    import ray.train

    if ray.train.get_context().get_world_rank() == 1:
        raise ValueError("rank 1 met a bug of the user's")


@pytest.mark.usefixtures("ray_cluster", "by_value")
def test_a_failed_fit_names_each_ranks_failure_as_ray_trains_error_does(tmp_path):
    """A bug (not a mistake we can name) on rank 1, no restart left: fit raises TrainingFailed, a
    ray.train.TrainingFailedError, in one line, and `worker_failures` (the name Ray Train's
    WorkerGroupError gives it) holds rank 1's own exception, of its class.
    Not smaller: one fit whose worker group fails on Ray Train; Ray Train's own error is what is compared,
    which the harness does not have."""
    import ray.train

    with pytest.raises(ray.train.TrainingFailedError) as ei:
        ray_resume.fit(
            raises_on_rank_1,
            checkpoint={"save_path": str(tmp_path / "ckpt")},
            scaling_config={"num_workers": 2},
            failure_config={"max_failures": 0},
        )
    failed = ei.value
    assert isinstance(failed, ray_resume.TrainingFailed)
    assert str(failed) == "training failed: rank 1: ValueError: rank 1 met a bug of the user's"
    assert set(failed.worker_failures) == {1}
    assert isinstance(failed.worker_failures[1], ValueError)
    assert "rank 1 met a bug of the user's" in str(failed.worker_failures[1])
    (note,) = failed.worker_failures[1].__notes__  # the rank's traceback, which Ray Train keeps in its log only
    assert note.startswith("rank 1's traceback:\nTraceback (most recent call last):"), note
    assert "in raises_on_rank_1" in note and note.endswith("ValueError: rank 1 met a bug of the user's"), note


def test_a_ranks_error_crosses_processes_as_its_class_its_problems_and_its_traceback():
    """RankError, what a rank sends the controller: rebuilt on the driver as the class the rank raised (a
    user's own subclass as the nearest of ray_resume's), ConfigError's problems whole; a name that is not a
    user error is refused where it is received."""
    import pickle

    from ray_resume.errors import AbnormalIteration, CheckpointError, ConfigError, RankError

    class MyCheckpointError(AbnormalIteration):
        pass

    def raised(exc):
        try:
            raise exc
        except Exception as caught:
            return pickle.loads(pickle.dumps(RankError.of(3, caught))).error()

    problems = ["model.layers: must be positive", "training.lr: must be positive"]
    config = raised(ConfigError(problems))
    assert type(config) is ConfigError and config.problems == problems
    assert str(config).startswith("rank 3: 2 config problems:\n  - model.layers: must be positive")
    mine = raised(MyCheckpointError("iteration_00000004: abnormal"))
    assert type(mine) is AbnormalIteration and isinstance(mine, CheckpointError)
    assert str(mine) == "rank 3: iteration_00000004: abnormal"
    assert mine.__notes__[0].startswith("rank 3's traceback:\nTraceback (most recent call last):")
    assert mine.__notes__[0].endswith("MyCheckpointError: iteration_00000004: abnormal"), mine.__notes__
    with pytest.raises(TypeError, match="'ValueError', which is not one of ray_resume.errors' user errors"):
        RankError(0, "ValueError", "x")


def abnormal_on_rank_1(config: dict) -> None:
    import ray.train

    from ray_resume.errors import AbnormalIteration

    if ray.train.get_context().get_world_rank() == 1:
        with open(config["tries"], "a") as f:
            f.write("rank 1 ran\n")
        raise AbnormalIteration("iteration_00000008/common.json: ckpt_status 1")


@pytest.mark.usefixtures("ray_cluster", "by_value")
def test_a_ray_resume_error_a_rank_raises_reaches_fit_as_itself_with_the_ranks_traceback(tmp_path):
    """A mistake of the user's that a rank finds crosses as what it is: fit raises AbnormalIteration (a
    CheckpointError's subclass), not retried though failures were left, its traceback the rank's.
    Not smaller: one fit, on Ray Train, whose rank raises: the crossing of Ray Train's own error path is the
    point."""
    from ray_resume.errors import AbnormalIteration

    tries = tmp_path / "tries"
    with pytest.raises(AbnormalIteration) as ei:
        ray_resume.fit(
            abnormal_on_rank_1,
            train_loop_config={"tries": str(tries)},
            checkpoint={"save_path": str(tmp_path / "ckpt")},
            scaling_config={"num_workers": 2},
            failure_config={"max_failures": 2},
        )
    assert str(ei.value) == "rank 1: iteration_00000008/common.json: ckpt_status 1"
    (note,) = ei.value.__notes__
    assert note.startswith("rank 1's traceback:\nTraceback (most recent call last):"), note
    assert "in abnormal_on_rank_1" in note, note
    assert note.endswith("AbnormalIteration: iteration_00000008/common.json: ckpt_status 1"), note
    assert tries.read_text() == "rank 1 ran\n"  # a user's mistake is not retried


@pytest.mark.usefixtures("ray_cluster")
def test_a_train_func_the_workers_cannot_import_is_named_in_one_line(tmp_path):
    """A train_func in a module only the driver can import (here this test module, not sent by value):
    the one line names the module and where to put it, not Ray's 'input arguments could not be computed'."""
    with pytest.raises(ray_resume.TrainingFailed) as ei:
        ray_resume.fit(
            raises_on_rank_1,
            checkpoint={"save_path": str(tmp_path / "ckpt")},
            scaling_config={"num_workers": 2},
            failure_config={"max_failures": 0},
        )
    assert str(ei.value).startswith("training failed: the workers could not import module 'test_api'"), str(ei.value)
    assert "working_dir" in str(ei.value) and len(str(ei.value).splitlines()) == 1
