"""The config's sections: every key, its type, default and meaning (its comment), and the checks across keys."""

from __future__ import annotations

import inspect
import math
import re
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..checkpoint.format.digest import CHECKSUMS, DEFAULT_CHECKSUM
from ..errors import ConfigError
from .words import LOOKS, got, key_of, mentions, passed, problems, raise_if

DTYPES = ("float32", "bfloat16", "float16")
# DistributedDataParallel, or FSDP2 fully_shard (params and optimizer state sharded on dim 0)
STRATEGIES = ("ddp", "fsdp")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "wsd")  # the LR after warmup (train_loop.learning_rate)

# "" is an ImportPath: the built-in
SafeName, ImportPath, OptimizerPath = (Annotated[str, Field(pattern=p)] for p in LOOKS)
Count = Annotated[int, Field(ge=1)]
# PyYAML follows YAML 1.1, which reads "1e-3" (no dot) as a string; accept it for numbers.
_EXP_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
Number = Annotated[
    float, BeforeValidator(lambda v: float(v) if isinstance(v, str) and _EXP_FLOAT.match(v.strip()) else v)
]


def _key_comments(schema: dict, cls: type) -> None:
    """Each key's comment in the class's source as its JSON Schema description: the comment at the
    end of its line, else the comment lines right above it."""
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"^\s{4}#\s?(.*)$", line):
            above.append(m.group(1).strip())
            continue
        m = re.match(r"^\s{4}(\w+): ([^#]+)(#\s*(.+))?$", line)
        if m and m.group(1) in schema["properties"] and (m.group(4) or above):
            schema["properties"][m.group(1)]["description"] = (m.group(4) or " ".join(above)).strip()
        above = []


class _Raising(type(BaseModel)):
    """A section built by hand raises a ConfigError as from_dict does (pydantic builds nested
    sections itself, not through here, so their problems are collected with the others)."""

    def __call__(cls, **values):
        try:
            return super().__call__(**values)
        except ValidationError as e:
            found = problems(e.errors(), Config, key_of(Config, cls))
        raise ConfigError(found)  # outside the except: pydantic's text would show a credential


class _Section(BaseModel, metaclass=_Raising):
    # validate_default: an omitted section (default {}) is built and checked as a written one is,
    # and a check across keys runs on a default as well.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, json_schema_extra=_key_comments)


class ModelConfig(_Section):
    vocab_size: int = Field(256, ge=2)  # number of token ids (>= 2)
    seq_len: Count = 64  # tokens per sample (>= 1)
    d_model: Count = 128  # hidden width; must be divisible by n_heads
    n_layers: Count = 2  # transformer blocks
    n_heads: Count = 4  # attention heads
    dtype: Literal[DTYPES] = "float32"  # parameter/compute dtype: float32 | bfloat16 | float16
    dropout: Number = Field(0.0, ge=0, lt=1)  # dropout probability in [0, 1)
    # "pkg.module:fn" returning your nn.Module, called with this section as a dict ("" = built-in GPT)
    builder: ImportPath = ""
    args: dict[str, Any] = {}  # free-form settings for your builder
    # strategy fsdp: module class names to shard as units ([] = each module in an nn.ModuleList)
    fsdp_units: list[str] = []

    # A check across keys validates the later one and reads the earlier from info.data, where a key
    # that failed (and said so) is absent.
    @field_validator("n_heads")
    @classmethod
    def _divides_d_model(cls, n_heads: int, info: ValidationInfo) -> int:
        d_model = info.data.get("d_model")
        if d_model and d_model % n_heads:
            raise ConfigError(f"model.d_model ({d_model}) must be divisible by model.n_heads ({n_heads})")
        return n_heads


class SyntheticDataConfig(_Section):
    samples: Count = 4096  # number of synthetic samples to generate (>= 1)
    files: Count = 4  # parquet files to split them into (>= 1)
    row_groups_per_file: Count = 4  # row groups per file (>= 1)
    seed: int = 0  # RNG seed of the generated tokens
    # with max_doc_len: documents of min..max tokens instead of seq_len + 1 (for data.pack)
    min_doc_len: int = Field(0, ge=0)
    max_doc_len: int = Field(0, ge=0)  # with min_doc_len: the longest document (0 = seq_len + 1 tokens each)


class DataConfig(_Section):
    path: str = Field("./data/quickstart", min_length=1)  # dataset directory
    shuffle: bool = True  # shuffle sample order each epoch
    seed: int = 1234  # shuffle seed
    synthetic: Optional[SyntheticDataConfig] = None  # if set, generate the dataset at `path` when missing
    # parquet column -> numpy dtype for the batch, cast without loss ({} = input_ids: int32)
    columns: dict[str, str] = {}
    collate: ImportPath = ""  # "pkg.module:fn" turning a dict of numpy arrays into the batch your loss takes
    # "pkg.module:fn" preprocessing rows where they are read (Ray Data's read tasks or the rank): dict of numpy arrays -> the same rows, deterministic
    map: ImportPath = ""
    allow_change: bool = False  # resume although data.seed/shuffle/columns or the dataset differ from the checkpoint's
    eval_path: str = ""  # a held-out dataset (same columns) for the eval loss every training.eval_every steps
    # rows of input_ids are documents of any length, concatenated in the sample order and cut in seq_len + 1 token windows (docs/data.md)
    pack: bool = False
    # parts each epoch's order is cut in, read by the ranks they go to (0: the checkpoint's, else gcd(global_batch_size, 8)); docs/data.md
    lanes: int = Field(0, ge=0)
    # Ray Data's read tasks take the reads once reading in the rank takes more than this share of its time (0: always); docs/data.md
    read_tasks_above: float = Field(0.02, ge=0, le=1)

    @field_validator("columns")
    @classmethod
    def _numeric(cls, columns: dict[str, str]) -> dict[str, str]:
        p = []
        for name, dtype in columns.items():
            if name == "sample_id":
                p.append("data.columns.sample_id: sample_id is always read (it audits sample exactness); leave it out")
            try:
                if np.dtype(dtype).kind not in "biuf":
                    raise TypeError
            except TypeError:
                p.append(f"data.columns.{name} must be a numeric numpy dtype such as float32 or int64, got {dtype!r}")
        raise_if(p)
        return columns


class TrainingConfig(_Section):
    global_batch_size: Count = 32  # samples per optimizer step, across all workers
    micro_batch_size: Count = 8  # samples per forward/backward on one worker
    train_steps: Count = 200  # total optimizer steps (>= 1)
    lr: Number = Field(3.0e-4, gt=0)  # peak learning rate (> 0)
    seed: int = 42  # model-init / dropout seed
    # data parallelism: ddp (replicated) | fsdp (FSDP2 fully_shard, sharded on dim 0)
    strategy: Literal[STRATEGIES] = "ddp"
    warmup_steps: int = Field(0, ge=0)  # linear LR warmup steps (>= 0)
    # LR after warmup: constant | linear | cosine | wsd (warmup, stable, then a linear decay)
    lr_decay_style: Literal[LR_DECAY_STYLES] = "constant"
    min_lr: Number = 0.0  # where linear, cosine and wsd decay end, at train_steps (0 <= min_lr <= lr)
    # wsd: the decay takes this last fraction of the samples after warmup (0 < f <= 1)
    wsd_decay_fraction: Number = Field(0.1, gt=0, le=1)
    # a torch.optim.Optimizer class: "torch.optim.SGD", or "pkg.module:Class"
    optimizer: OptimizerPath = "torch.optim.AdamW"
    optimizer_args: dict[str, Any] = {}  # its keyword arguments besides lr and weight_decay ({momentum: 0.9})
    weight_decay: Number = Field(0.0, ge=0)  # the optimizer's weight decay (>= 0)
    # clip the global gradient norm to this (0 = off); DDP, FSDP2, accumulation and fp16 scaling included
    grad_clip: Number = Field(0.0, ge=0)
    log_every: Count = 10  # log metrics every N steps (>= 1)
    log_sample_ids: bool = False  # record every step's sample ids in the metrics (for audits and tests)
    loss: ImportPath = ""  # "pkg.module:fn" called as fn(model, batch) -> scalar tensor ("" = next-token loss)
    eval_every: int = Field(0, ge=0)  # eval loss on data.eval_path every N steps and at the end (0 = off)

    @field_validator("min_lr")
    @classmethod
    def _below_lr(cls, min_lr: float, info: ValidationInfo) -> float:
        lr = info.data.get("lr")
        if lr is not None and not 0 <= min_lr <= lr:
            raise ConfigError(f"training.min_lr must be between 0 and training.lr ({lr!r}), got {min_lr!r}")
        return min_lr

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches each worker accumulates per optimizer step."""
        return self.global_batch_size // (world_size * self.micro_batch_size)


class ScalingConfig(_Section):
    num_workers: Union[int, list[int]] = 2  # fixed worker count, or elastic [min, max]
    use_gpu: bool = False  # one GPU per worker
    # Ray resources each worker reserves, as Ray Train's ScalingConfig takes them
    # ({CPU: 4, GPU: 1, my_label: 1}); {} keeps Ray's default: 1 CPU, or 1 GPU with use_gpu.
    resources_per_worker: dict[str, Annotated[Number, Field(ge=0)]] = {}
    # elastic [min, max]: how often a healthy group looks for room to grow
    elastic_resize_interval_s: Number = Field(60.0, gt=0)

    @field_validator("num_workers", mode="wrap")
    @classmethod
    def _min_max(cls, n: Any, handler) -> Union[int, list[int]]:
        try:
            n = handler(n)
        except ValidationError:  # one line, not one per member of the union
            raise ConfigError(f"scaling.num_workers must be an integer or a list of integers, {got(n)}") from None
        if isinstance(n, int):
            raise_if([] if n >= 1 else [f"scaling.num_workers must be >= 1, got {n}"])
        elif len(n) != 2:
            raise ConfigError(f"scaling.num_workers as a list must be [min, max], got {n!r}")
        else:
            raise_if(
                [f"scaling.num_workers values must be >= 1, got {n!r}"] * (min(n) < 1)
                + [f"scaling.num_workers [min, max] needs min <= max, got {n!r}"] * (n[0] > n[1])
            )
        return n

    @property
    def world_sizes(self) -> list[int]:
        """Every world size this config may run at, ascending."""
        n = self.num_workers
        return [n] if isinstance(n, int) else list(range(n[0], n[1] + 1))

    @property
    def max_workers(self) -> int:
        return self.world_sizes[-1]


class FailureConfig(_Section):
    max_failures: int = Field(3, ge=-1)  # worker-group restarts Ray allows; -1 = unlimited
    # how often Ray Train polls the workers, so how soon a lost one is noticed (Ray's default: 2)
    health_check_interval_s: Number = Field(0.5, gt=0)
    # no longer used: a restarted rank is a new process Ray starts (docs/restarts.md); any of its old values (true, false, auto) is accepted with a warning, so that a config.yaml saved with a checkpoint before still loads, and none is saved
    fork_server: Union[bool, Literal["auto"], None] = Field(None, exclude=True)

    @field_validator("fork_server", mode="wrap")
    @classmethod
    def _bool_or_auto(cls, value: Any, handler) -> Union[bool, str, None]:
        try:
            return handler(value)
        except ValidationError:  # one line, not one per member of the union
            raise ConfigError(f"failure.fork_server must be true, false or auto, {got(value)}") from None

    def retired(self) -> list[str]:
        """What the driver warns of: keys this section still accepts and no longer uses."""
        return (
            []
            if self.fork_server is None
            else [
                f"failure.fork_server: {str(self.fork_server).lower()} is no longer used: restarted ranks are new "
                "processes Ray starts (docs/restarts.md); remove the key"
            ]
        )


class StorageConfig(_Section):
    """Object-storage connection. Without keys here the standard AWS credential chain applies:
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws,
    web identity (EKS service accounts), the instance's role."""

    endpoint_url: str = ""  # S3-compatible endpoint, e.g. http://127.0.0.1:9000 (env AWS_ENDPOINT_URL)
    region: str = ""  # bucket region (env AWS_REGION / AWS_DEFAULT_REGION)
    access_key_id: str = ""  # prefer the credential chain (env, profile, role) over plain text here
    # with access_key_id; keys given here are written <redacted> into every iteration's config.yaml
    secret_access_key: str = ""
    session_token: str = ""  # with temporary keys (env AWS_SESSION_TOKEN when the keys come from the env)


_OR_AUTO = {"memory_interleaved_steps": "an integer >= 0 or auto", "async_save": "true, false or auto"}


class CheckpointConfig(_Section):
    enable_save: bool = True  # write checkpoints during training
    save_path: str = ""  # checkpoint root: a local/NFS path, file://..., or s3://bucket/prefix
    save_interleaved_steps: Count = 1000  # save when global_step % N == 0, and after the last step
    # between saves, snapshot every rank's state into memory (Ray's object store) every N steps, for restarts (0 = off); auto: every group times one snapshot and its steps and takes the interval whose snapshots cost at most 5% of the time, off where the node's object store could not hold them (docs/restarts.md)
    memory_interleaved_steps: Union[Annotated[int, Field(ge=0)], Literal["auto"]] = "auto"
    no_save_optim: bool = False  # skip optimizer state when saving
    save_max: Count = 5  # iterations of this job to keep (never the tracker's, never an earlier job's)
    # a root to resume from (ours, MindFormers', a DCP checkpoint or torchtitan's folder of step-N/), or a model.safetensors directory's weights; "" = start fresh; equal to save_path = resume if there is something to resume
    load_path: str = ""
    no_load_optim: bool = False  # weights only: step 0, data from the start, the optimizer new (docs/scenarios.md B)
    # each byte read off storage once, by one rank, and broadcast to the others (docs/scenarios.md D)
    load_balanced: bool = False
    # write shards in the background, training waiting only for a snapshot copy (true), or on the training thread (false); auto: the group's first saves time both ways and it saves the cheaper way from its 4th save on (docs/how-it-works.md)
    async_save: Union[bool, Literal["auto"]] = True
    # who writes an async save: a writer process beside the rank (its own interpreter, SCHED_IDLE) or a thread in it; auto: the process on CPU ranks (Linux), the thread (pinned buffers) on GPU ranks
    async_writer: Literal["auto", "process", "thread"] = "auto"
    prefix: SafeName = "ckpt"  # shard file name prefix
    # digest of each 4 MiB block of a shard, checked on every load: xxh3-128 (fast) | sha256 (cryptographic, several times slower)
    checksum: Literal[tuple(CHECKSUMS)] = DEFAULT_CHECKSUM
    storage: StorageConfig = {}  # s3:// connection settings
    fallback: bool = True  # if the tracker's iteration is damaged, load the newest older one that verifies
    # the writer lease on save_path expires this long after a dead job's last renewal
    lease_ttl_s: Number = Field(60.0, gt=0)

    @field_validator("memory_interleaved_steps", "async_save", mode="wrap")
    @classmethod
    def _or_auto(cls, value: Any, handler, info: ValidationInfo) -> Union[int, bool, str]:
        try:
            return handler(value)
        except ValidationError:  # one line, not one per member of the union
            raise ConfigError(
                f"checkpoint.{info.field_name} must be {_OR_AUTO[info.field_name]}, {got(value)}"
            ) from None

    @field_validator("save_path")
    @classmethod
    def _set_to_save(cls, save_path: str, info: ValidationInfo) -> str:
        if info.data.get("enable_save") and not save_path:
            raise ConfigError("checkpoint.save_path must be set when checkpoint.enable_save is true")
        return save_path


class Config(_Section):
    name: SafeName  # run name; used in file names
    model: ModelConfig = {}  # network shape
    data: DataConfig = {}  # dataset location/order
    # optimisation (the built-in job's; null for ray_resume.fit's loops, which have their own)
    training: Optional[TrainingConfig] = {}
    scaling: ScalingConfig = {}  # Ray workers
    failure: FailureConfig = {}  # Ray restart budget
    checkpoint: CheckpointConfig = {}  # save/load

    def _across(self) -> list[str]:
        """Problems between sections, each valid on its own."""
        p = self._across_training() if self.training is not None else []
        if self.data.pack and set(self.data.columns or {"input_ids": ""}) != {"input_ids"}:
            p.append(f"data.pack packs one column, input_ids; data.columns names {sorted(self.data.columns)}")
        syn = self.data.synthetic
        if syn is not None and (syn.min_doc_len or syn.max_doc_len) and not 1 <= syn.min_doc_len <= syn.max_doc_len:
            p.append(
                f"data.synthetic needs 1 <= min_doc_len <= max_doc_len, got {syn.min_doc_len} and {syn.max_doc_len}"
            )
        return p

    def _across_training(self) -> list[str]:
        p: list[str] = []
        t, s = self.training, self.scaling
        gbs, mbs, sizes = t.global_batch_size, t.micro_batch_size, s.world_sizes
        bad = [w for w in sizes if gbs % (w * mbs)]
        if bad and isinstance(s.num_workers, int):
            w = bad[0]
            p.append(
                f"training.global_batch_size={gbs} is not divisible by scaling.num_workers ({w}) x "
                f"training.micro_batch_size ({mbs}) = {w * mbs}; choose a global_batch_size that is "
                f"a multiple of {w * mbs} (gradient accumulation makes up the rest)"
            )
        elif bad:
            lcm = math.lcm(*(w * mbs for w in sizes))
            detail = ", ".join(f"{w} x {mbs} = {w * mbs}" for w in bad)
            p.append(
                f"training.global_batch_size={gbs} is not divisible by world size x "
                f"training.micro_batch_size for world sizes {bad} of elastic scaling.num_workers="
                f"{s.num_workers} ({detail}); choose a global_batch_size that is a multiple of {lcm} "
                f"(gradient accumulation makes up the rest)"
            )
        if self.data.lanes and gbs % self.data.lanes:
            p.append(
                f"training.global_batch_size={gbs} is not a multiple of data.lanes={self.data.lanes}: every global batch "
                "takes as many samples from each lane; choose a multiple, or data.lanes: 0 (gcd(global_batch_size, 8))"
            )
        if t.eval_every and not self.data.eval_path:
            p.append(
                f"training.eval_every={t.eval_every} needs data.eval_path (a held-out dataset); set it, or eval_every: 0"
            )
        return p

    def pack_tokens(self) -> int:
        """Tokens per packed window with data.pack (seq_len + 1: the inputs and the shifted targets), else 0."""
        return self.model.seq_len + 1 if self.data.pack else 0

    @model_validator(mode="after")
    def _check_across(self) -> "Config":
        raise_if(self._across())
        return self

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "Config":
        """Validate a plain dict strictly; raise one ConfigError listing every problem."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: top level must be a mapping, got {type(d).__name__}")
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            errors = e.errors()
        found = problems(errors, cls)
        # pydantic skips _check_across once any key fails: run it on the keys that passed, the failed
        # ones at their defaults, and drop what it says about a failed key.
        failed = [".".join(map(str, err["loc"])) for err in errors if err["loc"]]
        found += [
            p
            for p in passed(cls, d, [err["loc"] for err in errors])._across()
            if p not in found and not any(mentions(p, key) for key in failed)
        ]
        raise ConfigError([f"{source}: {p}" for p in found])

    def to_dict(self) -> dict:
        """Plain YAML/JSON-safe dict that round-trips through from_dict."""
        return self.model_dump()
