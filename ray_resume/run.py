"""Entry point: `python -m ray_resume.run CONFIG.yaml [--set key=value ...]`.

On a laptop it starts a local Ray; under `ray job submit` (RAY_ADDRESS is
set) or with `--address` it joins that cluster. Mistakes a user can fix are
found here, on the driver, before any worker starts, and reported as one
clear line instead of a traceback from inside a worker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .checkpoint import names, paths, state
from .checkpoint.checkpointer import check_optimizer_state, check_weights, refuse_optimizer_change
from .checkpoint.state import optimizer_slots
from .checkpoint.fallback import select_iteration
from .checkpoint.lease import Lease
from .checkpoint.memory import MemoryKeeper
from .checkpoint.reader import export_specs, find_committed, is_export, open_iteration
from .checkpoint.schema import CheckpointError
from .checkpoint.storage import storage_for
from .config import Config, ConfigError, load_config, redacted
from .controller import CommitError, JobControllerActor
from .metrics import read_metrics
from .summary import summarize
from .data import (DEFAULT_COLUMNS, DEFAULT_LANES, DataError, ReadUnit, check_data_map, check_eval_set, check_lanes, data_fingerprint,
                   dataset_size, ensure_dataset, fingerprint_changes, scan_units)
from . import parallel
from .optim import optimizer_kwargs
from .plugins import make_model, resolve
from .train_loop import train_func
from .api import INTERNAL, rank_entry

logger = logging.getLogger("ray_resume")

USER_ERRORS = (ConfigError, CheckpointError, DataError)
CONTROLLER_NAME = "ray_resume.controller."  # + the job id: each job's controller is a named actor
# Stopped on request before train_steps (SIGTERM): saved and committed, to be resumed. Neither 0
# (finished) nor 1/2 (failed, refused): 128 + SIGTERM, the status a scheduler (Kubernetes, Slurm,
# a RayJob) expects of a job it preempted and requeues.
EXIT_STOPPED = 128 + signal.SIGTERM


@dataclass
class RunResult:
    committed_iteration: int | None  # the newest iteration this job committed
    checkpoint_path: str | None  # its directory
    metrics: dict = field(default_factory=dict)  # rank 0's last step: step, loss
    error: BaseException | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_resume.run", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key, value parsed as YAML (repeatable)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else start a local Ray)")
    parser.add_argument("--verbose", action="store_true", help="also show Ray Train's and Ray Data's own console lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = run(load_config(args.config, args.set), address=args.address, verbose=args.verbose)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(result.error, ConfigError):  # a user's mistake a rank found (not retried)
        print(f"error: {result.error}", file=sys.stderr)
        return 2
    if result.error is not None:
        print(f"error: training failed: {result.error}", file=sys.stderr)
        return 1
    return EXIT_STOPPED if result.metrics.get("stopped") else 0


def scaling_config(scaling) -> ray.train.ScalingConfig:
    """Ray Train's ScalingConfig for the `scaling:` section (a [min, max] list makes it elastic)."""
    workers = scaling.num_workers
    return ray.train.ScalingConfig(
        num_workers=tuple(workers) if isinstance(workers, list) else workers, use_gpu=scaling.use_gpu,
        resources_per_worker=dict(scaling.resources_per_worker) or None,
        elastic_resize_monitor_interval_s=scaling.elastic_resize_interval_s,
    )


def run(cfg: Config, address: str | None = None, *, build_model=None, loss=None, collate=None,
        verbose: bool = False) -> RunResult:
    """Run the job to the end (with Ray Train's restarts) and report what was committed.

    `build_model`, `loss` and `collate` override the config's import paths
    (see ray_resume.plugins); all are checked here, before Ray starts.
    `verbose` keeps Ray Train's and Ray Data's own console lines (recovered
    failures' tracebacks, banners, progress bars); otherwise they go to
    Ray's log files only and the console shows ours.
    """
    cfg = with_lanes(absolute_paths(cfg))
    plugins = resolve(cfg, build_model=build_model, loss=loss, collate=collate)
    if cfg.training.strategy == "fsdp" and cfg.model.fsdp_units:
        with torch.device("meta"):  # check the unit class names without allocating the model
            parallel.fsdp_units(make_model(plugins, cfg), cfg.model.fsdp_units)
    # Ray Train keeps train_loop_config in its run state (the dashboard shows it): credentials stay
    # out of it, and the ranks take the whole config from the controller.
    units = data_units(cfg)
    loop_config = {"config": redacted(cfg.to_dict()), "plugins": plugins, "verbose": verbose,
                   "units": [dataclasses.astuple(u) for u in units]}
    return launch(cfg, train_func, loop_config, check=lambda: preflight(cfg, plugins, units), address=address, verbose=verbose)


def launch(cfg: Config, train_func, train_loop_config: dict, *, check, address: str | None, verbose: bool,
           summary: bool = True) -> RunResult:
    """Every job's driver (`ray_resume.fit`'s, and the built-in one's through `run`): while it holds
    the writer lease, `check()` (the driver's checks; what to load), then the job's controller and a
    TorchTrainer running `train_func(train_loop_config)` on every rank with its RankCheckpointer, to
    the end (with Ray Train's restarts); what was committed, and why it failed if it did."""
    job_id = uuid.uuid4().hex[:12]
    lease = None
    if cfg.checkpoint.enable_save:  # before anything under save_path is read for writing or moved
        lease = Lease(storage_for(cfg.checkpoint.save_path, cfg.checkpoint.storage), cfg.checkpoint.save_path, job_id, cfg.checkpoint.lease_ttl_s)
        lease.acquire()
        lease.keep_renewed()  # from this moment to the job's end
    try:
        internal = {"train_func": train_func, "load": check(), "job_id": job_id}
        return _run_trainer(cfg, address, job_id, {**train_loop_config, INTERNAL: internal}, verbose=verbose, summary=summary)
    finally:
        if lease:
            lease.release()


def _run_trainer(cfg: Config, address: str | None, job_id: str, loop_config: dict, *, verbose: bool, summary: bool) -> RunResult:
    init_ray(address, cfg)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # On the driver's node: the commit must run where the driver does (it dies with it).
    keepers = start_keepers() if cfg.checkpoint.memory_interleaved_steps else {}
    controller = JobControllerActor.options(scheduling_strategy=here, name=f"{CONTROLLER_NAME}{job_id}").remote(
        cfg.checkpoint.save_path, job_id, cfg.to_dict(), os.getpid(), keepers
    )
    ring = list(keepers.values())
    ray.get([keeper.attach.remote(controller, ring[(i + 1) % len(ring)] if len(ring) > 1 else None)
             for i, keeper in enumerate(ring)])
    trainer = TorchTrainer(
        rank_entry,
        train_loop_config={**loop_config, "controller": controller},
        scaling_config=scaling_config(cfg.scaling),
        run_config=ray.train.RunConfig(
            name=f"{cfg.name}-{job_id}",
            failure_config=ray.train.FailureConfig(max_failures=cfg.failure.max_failures),
            # Ray Train's own lines (worker-group starts, a recovered failure's 60-line
            # tracebacks, a surviving rank's "Error in training function") to its log files
            # only: a failure that ends the run raises from fit(), and main() prints its cause.
            logging_config=ray.train.LoggingConfig(log_level="INFO" if verbose else "CRITICAL"),
            callbacks=[FailedRanks(controller)],
        ),
    )
    error = None
    started = time.monotonic()
    # Read by Ray Train when fit() starts its controller (and handed on to it): a lost worker is
    # noticed within one interval, 2 s by Ray's default, 0.5 s by ours (a poll is one small call per worker).
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.failure.health_check_interval_s)
    try:
        with stop_on_sigterm(controller, cfg.name):
            trainer.fit()
    except Exception as exc:  # Ray wraps worker errors; report them, keep what was committed
        error = exc
    wall_s = time.monotonic() - started
    outcome = ray.get(controller.result.remote())
    ray.get(controller.release.remote())
    for keeper in keepers.values():  # the job's snapshots go with it
        ray.kill(keeper)
    if summary:
        say_summary(cfg, job_id, outcome["attempts"], wall_s)
    if outcome["user_error"]:  # what Ray Train's error wraps, in our words (it was not retried)
        error = ConfigError(outcome["user_error"])
    elif error is None and outcome["error"]:
        error = CommitError(outcome["error"])
    committed = outcome["committed"]
    path = paths.iteration_dir(cfg.checkpoint.save_path, committed) if committed is not None else None
    if error is None and outcome["metrics"].get("stopped"):
        logger.warning("[%s] stopped at step %s on request: committed iteration %s; run again with "
                       "checkpoint.load_path=%s to continue", cfg.name, outcome["metrics"]["step"], committed, cfg.checkpoint.save_path)
    elif error is None:
        logger.info("[%s] finished: last committed iteration %s%s", cfg.name, committed, f" at {path}" if path else "")
    if path:
        root = cfg.checkpoint.save_path
        logger.info("[%s] to continue it: --set checkpoint.load_path=%s; to export its weights: ray-resume export %s OUT_DIR",
                    cfg.name, root, root)
    return RunResult(committed, path, outcome["metrics"], error)


def start_keepers() -> dict:
    """A MemoryKeeper on every live node, owned by this driver: the memory tier's snapshots outlive
    the worker groups (a node that joins later sends its ranks' to another node's keeper). Each
    replicates its snapshots to the next one (attach, below)."""
    actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(MemoryKeeper)
    return {node["NodeID"]: actor.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
        for node in ray.nodes() if node["Alive"]}


def say_summary(cfg: Config, job_id: str, attempts: list[dict], wall_s: float) -> None:
    """The run's summary lines, from its metrics beside the checkpoint root (none without saves)."""
    if not cfg.checkpoint.enable_save:
        return
    try:
        records = read_metrics(cfg.checkpoint.save_path, cfg.checkpoint.storage)
    except OSError as exc:
        logger.warning("[%s] no summary: the metrics could not be read (%s)", cfg.name, exc)
        return
    for line in summarize(records, attempts, job_id=job_id, global_batch_size=cfg.training.global_batch_size, wall_s=wall_s):
        logger.info("[%s] %s", cfg.name, line)


class FailedRanks(ray.train.UserCallback):
    """On Ray Train's controller: which ranks failed, and the first line of why, for the line a
    restarted group says (the full errors stay in Ray Train's log files)."""

    def __init__(self, controller):
        self.controller = controller

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        why = {rank: (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160] for rank, exc in worker_exceptions.items()}
        self.controller.ranks_failed.remote(why)


@contextlib.contextmanager
def stop_on_sigterm(controller, name: str):
    """SIGTERM (a preemption notice, `kill`, a scheduler's grace period) becomes a clean stop:
    the ranks save and commit at the next step boundary and the run returns."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return

    def on_sigterm(signum, frame):
        logger.warning("[%s] SIGTERM: saving a checkpoint at the next step boundary, then stopping", name)
        controller.request_stop.remote()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def absolute_paths(cfg: Config) -> Config:
    """Workers may run in another directory: hand them absolute local paths."""

    def fix(path: str) -> str:
        return os.path.abspath(path) if path and "://" not in path else path

    ckpt = cfg.checkpoint.model_copy(update={"save_path": fix(cfg.checkpoint.save_path), "load_path": fix(cfg.checkpoint.load_path)})
    data = cfg.data.model_copy(update={"path": fix(cfg.data.path), "eval_path": fix(cfg.data.eval_path)})
    return cfg.model_copy(update={"data": data, "checkpoint": ckpt})


def with_lanes(cfg: Config) -> Config:
    """`data.lanes: 0` made definite: the lanes of the checkpoint a full resume continues (1 if it has
    none: its order was made before there were lanes), else gcd(global_batch_size, DEFAULT_LANES)."""
    if cfg.data.lanes:
        return cfg
    lanes = math.gcd(cfg.training.global_batch_size, DEFAULT_LANES)
    ckpt = cfg.checkpoint
    load = find_load_source(ckpt) if ckpt.load_path and not ckpt.no_load_optim else None
    if load and load[1] is not None:
        lanes = open_iteration(storage_for(load[0], ckpt.storage), *load).ours.get("data", {}).get("lanes", 1)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"lanes": lanes})})


def data_units(cfg: Config) -> list[ReadUnit]:
    """The dataset's row groups: listed and their footers read once, here, for every rank."""
    ensure_dataset(cfg.data.path, cfg.data.synthetic, cfg.model.seq_len, cfg.model.vocab_size)
    return scan_units(cfg.data.path, cfg.data.columns or None, cfg.checkpoint.storage, cfg.pack_tokens())


def preflight(cfg: Config, plugins=None, units: list[ReadUnit] | None = None) -> tuple[str, int | None] | None:
    """Check data (`units`, listed here if not given), checkpoints and that they fit the model
    (`plugins`', the config's by default), on the driver; return what to load: (root, step),
    (export_dir, None) or None."""
    units = units or data_units(cfg)
    plugins = plugins or resolve(cfg)
    if plugins.data_map:
        check_data_map(units, plugins.data_map, cfg.data.columns or DEFAULT_COLUMNS, cfg.checkpoint.storage, cfg.pack_tokens())
    if cfg.training.eval_every:
        check_eval_set(cfg.data.eval_path, cfg.data.columns or None, cfg.scaling.max_workers * cfg.training.micro_batch_size,
                       cfg.checkpoint.storage, cfg.pack_tokens())
    load, storage = find_resume(cfg)
    if not load:
        return load
    if load[1] is None:
        refuse_misfit_weights(cfg, plugins, export_specs(storage, load[0]), load[0])
        return load
    it = open_iteration(storage, *load)  # once, for the refusals below
    refuse_misfit_weights(cfg, plugins, it.specs(paths.MODEL_KIND), paths.join(it.path, paths.METADATA),
                          optimizer=it.specs(paths.OPTIM_KIND) if not cfg.checkpoint.no_load_optim else None)
    if cfg.checkpoint.enable_save and load[0] == cfg.checkpoint.save_path:
        refuse_step_rewind(cfg, it)
    if not cfg.checkpoint.no_load_optim:
        refuse_data_change(cfg, it, units)
        check_lanes(cfg.data.lanes, cfg.training.global_batch_size, dataset_size(units), it.common["consumed_samples"])
        kwargs = {"lr": cfg.training.lr, **optimizer_kwargs(plugins.optimizer, cfg.training.weight_decay, cfg.training.optimizer_args)}
        refuse_optimizer_change(it, plugins.optimizer, "training.optimizer builds {now}", "{now} from its weights",
                                "set training.optimizer back", slots=optimizer_slots(plugins.optimizer, kwargs))
    return load


def find_resume(cfg: Config) -> tuple[tuple[str, int | None] | None, object]:
    """The checkpoint side of the driver's checks (also `ray_resume.fit`'s): what `load_path` names,
    and its storage; a save_path that would overwrite committed iterations is refused."""
    ckpt = cfg.checkpoint
    if not ckpt.enable_save:
        logger.warning("[%s] checkpoints are off (checkpoint.enable_save: false): nothing will be saved", cfg.name)
    load = find_load_source(ckpt) if ckpt.load_path else None
    if ckpt.enable_save and (load is None or load[0] != ckpt.save_path):
        save_storage = storage_for(ckpt.save_path, ckpt.storage)
        existing = find_committed(save_storage, ckpt.save_path) if save_storage.is_dir(ckpt.save_path) else None
        if existing is not None:
            raise CheckpointError(
                f"checkpoint.save_path {ckpt.save_path!r} already holds committed iteration {existing} of an earlier run; "
                "set checkpoint.load_path to the same directory to resume it, or choose an empty save_path"
            )
    if load and load[1] is not None and ckpt.enable_save and load[0] == ckpt.save_path and ckpt.no_load_optim:
        raise CheckpointError(
            f"checkpoint.save_path {ckpt.save_path!r} holds committed iteration {load[1]}, and no_load_optim: true "
            "starts over at step 0, so this run's saves would overwrite it; set checkpoint.save_path to a new "
            "directory (checkpoint.load_path stays where it is)"
        )
    return load, storage_for(load[0], ckpt.storage) if load else None


def refuse_misfit_weights(cfg: Config, plugins, saved: dict, where: str, optimizer: dict | None = None) -> None:
    """Weights that do not fit the model (names, shapes, dtypes), and `optimizer` state of parameters it
    lacks, are the user's to fix: found here, on the model built on the meta device (no memory), not
    in every rank of every attempt."""
    try:
        with torch.device("meta"):
            model = make_model(plugins, cfg)
    except ConfigError:
        raise
    except Exception as exc:  # a builder that cannot build on the meta device (it reads weights, say): the ranks check
        logger.debug("[%s] weights not checked on the driver: the model does not build on the meta device (%s)", cfg.name, exc)
        return
    check_weights(state.model_tensors(model), saved, state.tied_aliases(model), where)
    if optimizer:
        per_param = {n: spec for n, spec in optimizer.items() if names.parse_state_name(n)[0] is not None}
        check_optimizer_state(per_param, {n: tuple(p.shape) for n, p in model.named_parameters()}, where)


def refuse_data_change(cfg: Config, it, units) -> None:
    """A full resume continues the saved data cursor; with another seed, shuffle, columns or dataset
    it would continue another order, silently. Refused unless `data.allow_change` says it is meant."""
    step = it.step
    saved = it.ours.get("data")
    if saved is None:  # written before the fingerprint was kept
        return
    columns = cfg.data.columns or DEFAULT_COLUMNS
    changes = fingerprint_changes(saved, data_fingerprint(units, cfg.data.seed, cfg.data.shuffle, columns, cfg.data.lanes, cfg.pack_tokens()))
    if not changes:
        return
    what = "; ".join(changes)
    if cfg.data.allow_change:
        logger.warning("[%s] data changed since iteration %d (%s); data.allow_change: true, so training continues "
                       "at sample %d of the new order", cfg.name, step, what, it.common["consumed_samples"])
        return
    raise CheckpointError(
        f"{paths.join(it.path, paths.COMMON)}: iteration {step} was trained on other data than this config reads "
        f"({what}), so resuming would continue another sample order; set data.allow_change: true if the change is "
        "meant (its data cursor carries over), or restore the data settings"
    )


def refuse_step_rewind(cfg: Config, it) -> None:
    """A smaller resume step (a larger global_batch_size, spec 1.4) would save into the
    iteration directories of the run it resumes, committed ones included, while the
    tracker still names them: a crash then could leave the tracker on a half-rewritten
    iteration. Such a resume must write to a new save_path."""
    root, step = it.root, it.step
    resume_step = it.common["consumed_samples"] // cfg.training.global_batch_size
    if resume_step < step:
        raise CheckpointError(
            f"global_batch_size {it.common['global_batch_size']} -> {cfg.training.global_batch_size} resumes iteration {step} "
            f"at step {resume_step}, and its saves would overwrite iterations up to {step} in {root}; "
            "set checkpoint.save_path to a new directory (checkpoint.load_path stays where it is)"
        )


def find_load_source(ckpt) -> tuple[str, int | None] | None:
    """What `checkpoint.load_path` names: (root, iteration), (export dir, None), or None (nothing yet)."""
    storage = storage_for(ckpt.load_path, ckpt.storage)
    resuming_own_root = ckpt.load_path == ckpt.save_path
    if not storage.is_dir(ckpt.load_path):
        if resuming_own_root:  # the first run of a "resume if there is anything" config
            logger.info("nothing to resume in %s yet: starting from step 0", ckpt.load_path)
            return None
        raise CheckpointError(
            f"checkpoint.load_path {ckpt.load_path!r} does not exist or is not a directory; "
            "point it at the save_path of the run to resume (its root, not an iteration_* directory)"
        )
    if is_export(storage, ckpt.load_path):
        if not ckpt.no_load_optim:
            raise CheckpointError(
                f"checkpoint.load_path {ckpt.load_path!r} is a weights-only safetensors export (no optimizer state); "
                "set checkpoint.no_load_optim: true to start from its weights"
            )
        return ckpt.load_path, None
    step = select_iteration(storage, ckpt.load_path, fallback=ckpt.fallback)
    if step is None:
        if resuming_own_root:
            logger.info("nothing to resume in %s yet: starting from step 0", ckpt.load_path)
            return None
        raise CheckpointError(
            f"checkpoint.load_path {ckpt.load_path!r} holds neither {paths.TRACKER} nor model.safetensors; "
            "point it at a checkpoint root written by ray_resume or at a safetensors export"
        )
    it = open_iteration(storage, ckpt.load_path, step)
    if not ckpt.no_load_optim and not it.has_optimizer:
        raise CheckpointError(
            f"{it.path}: iteration {step} was saved without optimizer state (checkpoint.no_save_optim: true); "
            "set checkpoint.no_load_optim: true to start from its weights"
        )
    return ckpt.load_path, step


def init_ray(address: str | None, cfg: Config) -> None:
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # Room for the training workers plus the Ray Data read tasks beside them.
        init_local_ray(num_cpus=max(os.cpu_count() or 1, cfg.scaling.max_workers + 2))


def init_local_ray(**options) -> str:
    """Start a new Ray of our own (never a stale `ray start` cluster) with its dashboard on a
    free loopback port; returns the dashboard's URL.

    Ray Train v2's placement-group cleaner asks the state API, which the dashboard serves,
    whether the controller is alive, and `fit()` returns only once that call is done or 12 s
    have passed. Without a dashboard, or when the state API finds another Ray (the
    `/tmp/ray/ray_current_cluster` file a `ray start` leaves behind, a second Ray on the
    host), each call hangs 10-40 s: every job ended 12 s late and logged "Failed to query
    Ray Train Controller actor state". RAY_API_SERVER_ADDRESS sends the state API of every
    process of this job to our own dashboard.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": url}}, **options)
    return url


if __name__ == "__main__":
    sys.exit(main())
