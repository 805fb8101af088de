"""Your model, loss and batch by import path, or as Python callables.

`model.builder: "pkg.module:fn"` is called with the `model` section as a dict
and returns an `nn.Module`; `training.loss: "pkg.module:fn"` is called as
`fn(model, batch)` and returns a scalar tensor; `data.collate` turns a dict of
numpy arrays (the configured `data.columns`, one micro-batch) into that
batch; `data.map` preprocesses the rows Ray Data reads, in its read tasks;
`training.optimizer` names a `torch.optim.Optimizer` class, built with
`training.optimizer_args` (tried on a one-element parameter). Everything is resolved and its signature checked on the driver, before
any worker starts, so a typo fails in a second with the key that holds it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .config import Config

from .data import Tokens
from .errors import ConfigError
from .model import DTYPES, build_model, lm_loss
from .optim import optimizer_kwargs


@dataclass
class Plugins:
    build_model: Callable
    loss: Callable
    collate: Callable
    optimizer: type = torch.optim.AdamW
    data_map: Callable | None = None  # data.map: run by Ray Data on the rows it reads (see ray_resume.data)


def default_collate(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Numpy columns to tensors (a copy: Ray Data hands out read-only arrays)."""
    return {name: torch.tensor(a) for name, a in arrays.items()}


def next_token_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return lm_loss(model, batch["input_ids"])


def build_builtin(model_section: dict):
    return build_model(_Section(**model_section))


class _Section:
    def __init__(self, **values):
        self.__dict__.update(values)


def load_callable(key: str, path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or any error the module raises while importing
        raise ConfigError(
            f"{key}: cannot import module {module_name!r} of {path!r}: {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r} (from {path!r})")
    if not callable(fn):
        raise ConfigError(f"{key}: {path!r} is a {type(fn).__name__}, not a function")
    return fn


def check_signature(key: str, fn: Callable, params: tuple[str, ...]) -> None:
    """`fn` must be callable with exactly these positional arguments."""
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"{key}: {name} must accept ({', '.join(params)}): {exc}") from None
    except ValueError:
        pass  # builtins without a signature: trust them


def resolve(cfg: Config, *, build_model=None, loss=None, collate=None) -> Plugins:
    """The callables of this job: explicit arguments win, then import paths, then the built-ins."""
    chosen = {}
    for key, given, path, builtin, params in (
        ("model.builder", build_model, cfg.model.builder, build_builtin, ("model_section",)),
        ("training.loss", loss, cfg.training.loss, next_token_loss, ("model", "batch")),
        ("data.collate", collate, cfg.data.collate, default_collate, ("arrays",)),
    ):
        fn = given or (load_callable(key, path) if path else builtin)
        check_signature(key, fn, params)
        chosen[key] = fn
    data_map = load_callable("data.map", cfg.data.map) if cfg.data.map else None
    if data_map:
        check_signature("data.map", data_map, ("batch",))
    return Plugins(
        chosen["model.builder"], chosen["training.loss"], chosen["data.collate"], load_optimizer(cfg.training), data_map
    )


def load_optimizer(training) -> type:
    """`training.optimizer`'s class, refused here (the driver) unless it takes `optimizer_args`."""
    path = training.optimizer
    cls = load_callable("training.optimizer", path if ":" in path else ":".join(path.rsplit(".", 1)))
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"training.optimizer: {path!r} is not a torch.optim.Optimizer class")
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(
            f"training.optimizer: {cls.__name__}.step needs a closure, and the built-in loop calls step() "
            "without one; use ray_resume.fit with your own loop for it"
        )
    try:
        cls(
            [torch.nn.Parameter(torch.zeros(1))],
            lr=training.lr,
            **optimizer_kwargs(cls, training.weight_decay, training.optimizer_args),
        )
    except (TypeError, ValueError) as exc:  # an unknown keyword, or a value it refuses
        raise ConfigError(f"training.optimizer_args: {cls.__name__} refuses {training.optimizer_args}: {exc}") from None
    return cls


def expected_tokens(plugins: Plugins, cfg: Config) -> Tokens | None:
    """What the built-in batch (`data.columns` unset) takes from `input_ids`; the token ids' bound
    only for the built-in model, whose vocabulary model.vocab_size is. None with columns of the user's."""
    if cfg.data.columns:
        return None
    vocab = cfg.model.vocab_size if plugins.build_model is build_builtin else None
    return Tokens(cfg.model.seq_len + 1, bool(cfg.data.pack), vocab)


def make_model(plugins: Plugins, cfg: Config) -> torch.nn.Module:
    model = plugins.build_model(cfg.model.model_dump())
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.builder returned {type(model).__name__}, not a torch.nn.Module")
    return model.to(DTYPES[cfg.model.dtype])
