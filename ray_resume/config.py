"""Typed, strict configuration for ray_resume.

A config is a YAML mapping validated into frozen-shape dataclasses. Validation
is strict and *collecting*: every problem (unknown key, wrong type, impossible
value, cross-field conflict) is gathered and raised together as one
:class:`ConfigError`, each line naming the full dotted key and the source file.
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import numpy as np
import yaml

from .checkpoint.digest import CHECKSUMS, DEFAULT_CHECKSUM

logger = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
DTYPES = ("float32", "bfloat16", "float16")
STRATEGIES = ("ddp", "fsdp")  # DistributedDataParallel, or FSDP2 fully_shard (params and optimizer state sharded on dim 0)
LR_DECAY_STYLES = ("constant", "linear", "cosine", "wsd")  # the LR after warmup (train_loop.learning_rate)
FAULT_PHASES = ("after_optimizer_step", "mid_shard_write", "before_report", "commit_before_tracker", "retention_delete", "commit_fails")


class ConfigError(ValueError):
    """All problems found in a config; ``.problems`` holds one line per problem."""

    def __init__(self, problems: str | Iterable[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_OPTIMIZER_PATH = re.compile(r"^[A-Za-z_][\w.]*[.:][A-Za-z_]\w*$")


def _import_path(problems: list[str], key: str, value: str) -> None:
    if value and not _IMPORT_PATH.match(value):
        problems.append(f"{key} must look like 'package.module:function', got {value!r}")


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


def _at_least(problems: list[str], key: str, value: Any, low: float) -> None:
    if value < low:
        problems.append(f"{key} must be >= {low}, got {value!r}")


def _one_of(problems: list[str], key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        problems.append(f"{key} must be one of {', '.join(allowed)}; got {value!r}")


# While set, sections skip raising on construction: the builder collects instead.
_DEFER_CHECKS = contextvars.ContextVar("_DEFER_CHECKS", default=False)


class _Section:
    """Mixin: run ``_check`` on construction and raise every problem at once."""

    def __post_init__(self) -> None:
        if not _DEFER_CHECKS.get():
            _raise_if(self._check())

    def _check(self) -> list[str]:
        return []


@dataclass(kw_only=True)
class ModelConfig(_Section):
    vocab_size: int = 256  # number of token ids (>= 2)
    seq_len: int = 64  # tokens per sample (>= 1)
    d_model: int = 128  # hidden width; must be divisible by n_heads
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention heads
    dtype: str = "float32"  # parameter/compute dtype: float32 | bfloat16 | float16
    dropout: float = 0.0  # dropout probability in [0, 1)
    builder: str = ""  # "pkg.module:fn" returning your nn.Module, called with this section as a dict ("" = built-in GPT)
    args: dict[str, Any] = field(default_factory=dict)  # free-form settings for your builder
    fsdp_units: list[str] = field(default_factory=list)  # strategy fsdp: module class names to shard as units ([] = each module in an nn.ModuleList)

    def _check(self) -> list[str]:
        p: list[str] = []
        _import_path(p, "model.builder", self.builder)
        _at_least(p, "model.vocab_size", self.vocab_size, 2)
        for k in ("seq_len", "d_model", "n_layers", "n_heads"):
            _at_least(p, f"model.{k}", getattr(self, k), 1)
        if self.d_model >= 1 and self.n_heads >= 1 and self.d_model % self.n_heads:
            p.append(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        _one_of(p, "model.dtype", self.dtype, DTYPES)
        if not 0.0 <= self.dropout < 1.0:
            p.append(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        return p


@dataclass(kw_only=True)
class SyntheticDataConfig(_Section):
    samples: int = 4096  # number of synthetic samples to generate (>= 1)
    files: int = 4  # parquet files to split them into (>= 1)
    row_groups_per_file: int = 4  # row groups per file (>= 1)
    seed: int = 0  # RNG seed of the generated tokens

    def _check(self) -> list[str]:
        p: list[str] = []
        for k in ("samples", "files", "row_groups_per_file"):
            _at_least(p, f"data.synthetic.{k}", getattr(self, k), 1)
        return p


@dataclass(kw_only=True)
class DataConfig(_Section):
    path: str = "./data/quickstart"  # dataset directory
    shuffle: bool = True  # shuffle sample order each epoch
    seed: int = 1234  # shuffle seed
    synthetic: Optional[SyntheticDataConfig] = None  # if set, generate the dataset at `path` when missing
    columns: dict[str, str] = field(default_factory=dict)  # parquet column -> numpy dtype for the batch, cast without loss ({} = input_ids: int32)
    collate: str = ""  # "pkg.module:fn" turning a dict of numpy arrays into the batch your loss takes
    allow_change: bool = False  # resume although data.seed/shuffle/columns or the dataset differ from the checkpoint's
    eval_path: str = ""  # a held-out dataset (same columns) for the eval loss every training.eval_every steps

    def _check(self) -> list[str]:
        p = [] if self.path else ["data.path must be a non-empty string"]
        _import_path(p, "data.collate", self.collate)
        for name, dtype in self.columns.items():
            if name == "sample_id":
                p.append("data.columns.sample_id: sample_id is always read (it audits sample exactness); leave it out")
            try:
                if np.dtype(dtype).kind not in "biuf":
                    raise TypeError
            except TypeError:
                p.append(f"data.columns.{name} must be a numeric numpy dtype such as float32 or int64, got {dtype!r}")
        return p


@dataclass(kw_only=True)
class TrainingConfig(_Section):
    global_batch_size: int = 32  # samples per optimizer step, across all workers
    micro_batch_size: int = 8  # samples per forward/backward on one worker
    train_steps: int = 200  # total optimizer steps (>= 1)
    lr: float = 3.0e-4  # peak learning rate (> 0)
    seed: int = 42  # model-init / dropout seed
    strategy: str = "ddp"  # data parallelism: ddp (replicated) | fsdp (FSDP2 fully_shard, sharded on dim 0)
    warmup_steps: int = 0  # linear LR warmup steps (>= 0)
    lr_decay_style: str = "constant"  # LR after warmup: constant | linear | cosine | wsd (warmup, stable, then a linear decay)
    min_lr: float = 0.0  # where linear, cosine and wsd decay end, at train_steps (0 <= min_lr <= lr)
    wsd_decay_fraction: float = 0.1  # wsd: the decay takes this last fraction of the samples after warmup (0 < f <= 1)
    optimizer: str = "torch.optim.AdamW"  # a torch.optim.Optimizer class: "torch.optim.SGD", or "pkg.module:Class"
    optimizer_args: dict[str, Any] = field(default_factory=dict)  # its keyword arguments besides lr and weight_decay ({momentum: 0.9})
    weight_decay: float = 0.0  # the optimizer's weight decay (>= 0)
    grad_clip: float = 0.0  # clip the global gradient norm to this (0 = off); DDP, FSDP2, accumulation and fp16 scaling included
    log_every: int = 10  # log metrics every N steps (>= 1)
    log_sample_ids: bool = False  # record every step's sample ids in the metrics (for audits and tests)
    loss: str = ""  # "pkg.module:fn" called as fn(model, batch) -> scalar tensor ("" = next-token loss)
    eval_every: int = 0  # eval loss on data.eval_path every N steps and at the end (0 = off)

    def _check(self) -> list[str]:
        p: list[str] = []
        _import_path(p, "training.loss", self.loss)
        for k in ("global_batch_size", "micro_batch_size", "train_steps", "log_every"):
            _at_least(p, f"training.{k}", getattr(self, k), 1)
        if not self.lr > 0:
            p.append(f"training.lr must be > 0, got {self.lr!r}")
        _one_of(p, "training.strategy", self.strategy, STRATEGIES)
        _at_least(p, "training.warmup_steps", self.warmup_steps, 0)
        _at_least(p, "training.eval_every", self.eval_every, 0)
        _at_least(p, "training.weight_decay", self.weight_decay, 0)
        _at_least(p, "training.grad_clip", self.grad_clip, 0)
        _one_of(p, "training.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if not 0 <= self.min_lr <= self.lr:
            p.append(f"training.min_lr must be between 0 and training.lr ({self.lr!r}), got {self.min_lr!r}")
        if not 0 < self.wsd_decay_fraction <= 1:
            p.append(f"training.wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction!r}")
        if not _OPTIMIZER_PATH.match(self.optimizer):
            p.append(f"training.optimizer must look like 'torch.optim.SGD' or 'package.module:Class', got {self.optimizer!r}")
        return p

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches each worker accumulates per optimizer step."""
        return self.global_batch_size // (world_size * self.micro_batch_size)


@dataclass(kw_only=True)
class ScalingConfig(_Section):
    num_workers: Union[int, list[int]] = 2  # fixed worker count, or elastic [min, max]
    use_gpu: bool = False  # one GPU per worker
    # Ray resources each worker reserves, as Ray Train's ScalingConfig takes them
    # ({CPU: 4, GPU: 1, my_label: 1}); {} keeps Ray's default: 1 CPU, or 1 GPU with use_gpu.
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    elastic_resize_interval_s: float = 60.0  # elastic [min, max]: how often a healthy group looks for room to grow

    def _check(self) -> list[str]:
        p = [f"scaling.resources_per_worker.{k} must be >= 0, got {v:g}" for k, v in self.resources_per_worker.items() if v < 0]
        if self.elastic_resize_interval_s <= 0:
            p.append(f"scaling.elastic_resize_interval_s must be > 0, got {self.elastic_resize_interval_s:g}")
        n = self.num_workers
        if isinstance(n, int):
            return p + ([] if n >= 1 else [f"scaling.num_workers must be >= 1, got {n}"])
        if len(n) != 2:
            return p + [f"scaling.num_workers as a list must be [min, max], got {n!r}"]
        if min(n) < 1:
            p.append(f"scaling.num_workers values must be >= 1, got {n!r}")
        if n[0] > n[1]:
            p.append(f"scaling.num_workers [min, max] needs min <= max, got {n!r}")
        return p

    @property
    def world_sizes(self) -> list[int]:
        """Every world size this config may run at, ascending."""
        n = self.num_workers
        return [n] if isinstance(n, int) else list(range(n[0], n[1] + 1))

    @property
    def max_workers(self) -> int:
        return self.world_sizes[-1]


@dataclass(kw_only=True)
class FailureConfig(_Section):
    max_failures: int = 3  # worker-group restarts Ray allows; -1 = unlimited

    def _check(self) -> list[str]:
        p: list[str] = []
        _at_least(p, "failure.max_failures", self.max_failures, -1)
        return p


@dataclass(kw_only=True)
class StorageConfig(_Section):
    """Object-storage connection. Without keys here the standard AWS credential chain applies:
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws,
    web identity (EKS service accounts), the instance's role."""

    endpoint_url: str = ""  # S3-compatible endpoint, e.g. http://127.0.0.1:9000 (env AWS_ENDPOINT_URL)
    region: str = ""  # bucket region (env AWS_REGION / AWS_DEFAULT_REGION)
    access_key_id: str = ""  # prefer the credential chain (env, profile, role) over plain text here
    secret_access_key: str = ""  # with access_key_id
    session_token: str = ""  # with temporary keys (env AWS_SESSION_TOKEN when the keys come from the env)


SECRET_STORAGE_KEYS = ("access_key_id", "secret_access_key", "session_token")
REDACTED = "<redacted>"


def redacted(config: dict) -> dict:
    """A copy of a config dict fit to write down: storage credentials replaced by REDACTED."""
    out = copy.deepcopy(config)
    storage = out.get("checkpoint", {}).get("storage") or {}
    for key in SECRET_STORAGE_KEYS:
        if storage.get(key):
            storage[key] = REDACTED
    return out


@dataclass(kw_only=True)
class CheckpointConfig(_Section):
    enable_save: bool = True  # write checkpoints during training
    save_path: str = ""  # checkpoint root: a local/NFS path, file://..., or s3://bucket/prefix
    save_interleaved_steps: int = 1000  # save every N optimizer steps (>= 1)
    memory_interleaved_steps: int = 0  # between saves, snapshot every rank's state into memory (Ray's object store) every N steps, for restarts (0 = off)
    no_save_optim: bool = False  # skip optimizer state when saving
    save_max: int = 5  # keep at most N checkpoints created by this job (>= 1)
    load_path: str = ""  # directory to resume from ("" = start fresh)
    no_load_optim: bool = False  # ignore optimizer state when loading
    load_balanced: bool = False  # spread checkpoint reads across ranks
    async_save: bool = True  # write shards in a background thread; training only waits for a snapshot copy
    prefix: str = "ckpt"  # shard file name prefix
    checksum: str = DEFAULT_CHECKSUM  # digest of each 4 MiB block of a shard, checked on every load: xxh3-128 (fast) | sha256 (cryptographic, ~15x slower)
    storage: StorageConfig = field(default_factory=StorageConfig)  # s3:// connection settings
    fallback: bool = True  # if the tracker's iteration is damaged, load the newest older one that verifies
    lease_ttl_s: float = 60.0  # the writer lease on save_path expires this long after a dead job's last renewal

    def _check(self) -> list[str]:
        p: list[str] = []
        _at_least(p, "checkpoint.save_interleaved_steps", self.save_interleaved_steps, 1)
        _at_least(p, "checkpoint.save_max", self.save_max, 1)
        _at_least(p, "checkpoint.memory_interleaved_steps", self.memory_interleaved_steps, 0)
        _one_of(p, "checkpoint.checksum", self.checksum, tuple(CHECKSUMS))
        if not _SAFE_NAME.match(self.prefix):
            p.append(f"checkpoint.prefix must be non-empty and use only [A-Za-z0-9._-], got {self.prefix!r}")
        if not self.lease_ttl_s > 0:
            p.append(f"checkpoint.lease_ttl_s must be > 0, got {self.lease_ttl_s!r}")
        if self.enable_save and not self.save_path:
            p.append("checkpoint.save_path must be set when checkpoint.enable_save is true")
        return p


@dataclass(kw_only=True)
class FaultConfig(_Section):
    phase: str  # where to die: after_optimizer_step | mid_shard_write | before_report | commit_before_tracker | retention_delete; or commit_fails (its tracker write fails)
    step: int  # optimizer step at which to die (>= 1)
    rank: int = 0  # which worker rank dies

    def _check(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "fault.phase", self.phase, FAULT_PHASES)
        _at_least(p, "fault.step", self.step, 1)
        _at_least(p, "fault.rank", self.rank, 0)
        return p


@dataclass(kw_only=True)
class Config(_Section):
    name: str  # run name; used in file names
    model: ModelConfig = field(default_factory=ModelConfig)  # network shape
    data: DataConfig = field(default_factory=DataConfig)  # dataset location/order
    training: TrainingConfig = field(default_factory=TrainingConfig)  # optimisation
    scaling: ScalingConfig = field(default_factory=ScalingConfig)  # Ray workers
    failure: FailureConfig = field(default_factory=FailureConfig)  # Ray restart budget
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # save/load
    fault: Optional[FaultConfig] = None  # test-only fault injection

    def _check(self) -> list[str]:
        p: list[str] = []
        if not _SAFE_NAME.match(self.name):
            p.append(f"name must be non-empty and use only [A-Za-z0-9._-], got {self.name!r}")
        t, s = self.training, self.scaling
        if s._check() or t.micro_batch_size < 1:
            return p  # already reported; the cross-field checks need valid values
        gbs, mbs, sizes = t.global_batch_size, t.micro_batch_size, s.world_sizes
        bad = [w for w in sizes if gbs % (w * mbs)]
        if bad and isinstance(s.num_workers, int):
            w = bad[0]
            p.append(f"training.global_batch_size={gbs} is not divisible by scaling.num_workers ({w}) x "
                     f"training.micro_batch_size ({mbs}) = {w * mbs}; choose a global_batch_size that is "
                     f"a multiple of {w * mbs} (gradient accumulation makes up the rest)")
        elif bad:
            lcm = math.lcm(*(w * mbs for w in sizes))
            detail = ", ".join(f"{w} x {mbs} = {w * mbs}" for w in bad)
            p.append(f"training.global_batch_size={gbs} is not divisible by world size x "
                     f"training.micro_batch_size for world sizes {bad} of elastic scaling.num_workers="
                     f"{s.num_workers} ({detail}); choose a global_batch_size that is a multiple of {lcm} "
                     f"(gradient accumulation makes up the rest)")
        if t.eval_every and not self.data.eval_path:
            p.append(f"training.eval_every={t.eval_every} needs data.eval_path (a held-out dataset); set it, or eval_every: 0")
        if self.fault is not None and self.fault.rank >= s.max_workers:
            p.append(f"fault.rank={self.fault.rank} must be < the largest world size "
                     f"scaling.num_workers ({s.max_workers})")
        return p

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "Config":
        """Validate a plain dict strictly; raise one ConfigError listing every problem."""
        problems: list[str] = []
        if not isinstance(d, dict):
            problems.append(f"top level must be a mapping, got {type(d).__name__}")
            obj = None
        else:
            token = _DEFER_CHECKS.set(True)
            try:
                obj = _build(cls, d, "", problems, [])
            finally:
                _DEFER_CHECKS.reset(token)
        if problems:
            raise ConfigError([f"{source}: {p}" for p in problems])
        return obj

    def to_dict(self) -> dict:
        """Plain YAML/JSON-safe dict that round-trips through from_dict."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- generic checker
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
_DUMMIES = {int: 1, float: 1.0, bool: False, str: "missing"}
# PyYAML follows YAML 1.1, which reads "1e-3" (no dot) as a string; accept it for numbers.
_EXP_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return "a list of integers" if typing.get_args(tp) == (int,) else "a list"
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _got(value: Any, key: str = "") -> str:
    """What a wrong value was, for an error message; a credential's value is never shown."""
    if key.rsplit(".", 1)[-1] in SECRET_STORAGE_KEYS:
        return f"got {type(value).__name__} {REDACTED}"
    return f"got {type(value).__name__} {value!r}"


def _convert(tp: Any, value: Any, key: str, problems: list[str], bad: list[str]) -> tuple[bool, Any]:
    """Check ``value`` against annotation ``tp``; return (ok, converted value)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, key, problems, bad)
        for a in options:
            trial: list[str] = []
            ok, out = _convert(a, value, key, trial, bad)
            if ok:
                return True, out
        problems.append(f"{key} must be {' or '.join(_describe(a) for a in options)}, {_got(value, key)}")
        return False, None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{key} must be a mapping, {_got(value)}")
            return False, None
        return True, _build(tp, value, key + ".", problems, bad)
    if origin is dict:
        _, item = typing.get_args(tp)
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            if item is Any:
                return True, dict(value)
            converted = {k: _convert(item, v, f"{key}.{k}", problems, bad) for k, v in value.items()}
            if all(ok for ok, _ in converted.values()):
                return True, {k: v for k, (_, v) in converted.items()}
            return False, None
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, list) and all(_convert(item, v, key, [], [])[0] for v in value):
            return True, [_convert(item, v, key, [], [])[1] for v in value]
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str) and _EXP_FLOAT.match(value.strip()):
            return True, float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
    elif isinstance(value, tp):
        return True, value
    problems.append(f"{key} must be {_describe(tp)}, {_got(value, key)}")
    return False, None


def _mentions(problem: str, key: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", problem) is not None


def _build(cls: type, data: dict, at: str, problems: list[str], bad: list[str]) -> Any:
    """Build dataclass ``cls`` from ``data`` (keys prefixed by ``at``), appending problems.

    Fields that fail are replaced by defaults (or placeholders) and their keys recorded in
    ``bad``, so the remaining checks still run but follow-on problems about them are dropped.
    Must run with _DEFER_CHECKS set.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(fields)})"
            problems.append(f"{at}{k}: unknown key{hint}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = at + name
        if name in data:
            ok, value = _convert(hints[name], data[name], key, problems, bad)
            if ok:
                kwargs[name] = value
                continue
            bad.append(key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{key} is required ({_describe(hints[name])})")
            bad.append(key)
        elif dataclasses.is_dataclass(hints[name]):  # omitted section: build (and check) its defaults
            kwargs[name] = _build(hints[name], {}, key + ".", problems, bad)
            continue
        else:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[name] = _DUMMIES.get(hints[name])  # placeholder so the other fields still get checked
    obj = cls(**kwargs)
    found = [p for p in obj._check() if not any(_mentions(p, b) for b in bad)]
    problems.extend(found)
    bad.extend(at + name for name in fields if any(_mentions(p, at + name) for p in found))
    return obj


# ---------------------------------------------------------------- loading
def apply_overrides(d: dict, overrides: Iterable[str]) -> dict:
    """Return a deep copy of ``d`` with ``dotted.key=value`` overrides (values parsed as YAML)."""
    out = copy.deepcopy(d)
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r} must look like dotted.key=value")
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            problems.append(f"override {item!r}: value is not valid YAML ({e})")
            continue
        *parents, leaf = key.split(".")
        node, walked = out, []
        for part in parents:
            walked.append(part)
            if node.get(part) is None:  # create absent/null optional blocks (e.g. fault)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {'.'.join(walked)} is not a mapping")
                break
        else:
            node[leaf] = value
    _raise_if(problems)
    return out


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Config:
    """Read a YAML config, apply ``overrides``, and validate it strictly."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read config file ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}: invalid YAML at {where}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    overrides = list(overrides)
    if overrides:
        try:
            raw = apply_overrides(raw, overrides)
        except ConfigError as e:
            raise ConfigError([f"{source}: {p}" for p in e.problems]) from None
        logger.debug("applied overrides to %s: %s", source, overrides)
    cfg = Config.from_dict(raw, source=source)
    logger.debug("loaded config %r from %s", cfg.name, source)
    return cfg


def json_schema() -> dict:
    """The JSON Schema of a config file, for editors (`python -m ray_resume.config schema`).

    pydantic's schema of these dataclasses, every section closed to keys it does not know, as
    `Config.from_dict` is, and every key described by its comment above. The checks that span
    keys (a batch size the world sizes divide, an import path that imports) stay in `from_dict`.
    """
    import pydantic

    schema = pydantic.TypeAdapter(Config).json_schema()
    for part in [schema, *schema.get("$defs", {}).values()]:  # each titled by its dataclass's name
        part["additionalProperties"] = False
        notes = _key_comments(globals()[part["title"]])
        for key, prop in part.get("properties", {}).items():
            if key in notes:
                prop["description"] = notes[key]
    return schema


def _key_comments(cls: type) -> dict[str, str]:
    """{key: its trailing comment} from the class's source."""
    import inspect

    notes = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"^\s{4}(\w+): [^#]+#\s*(.+)$", line)
        if m:
            notes[m.group(1)] = m.group(2).strip()
    return notes


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] != ["schema"]:
        sys.exit("usage: python -m ray_resume.config schema    # print the JSON Schema of a config file")
    print(json.dumps(json_schema(), indent=1))
