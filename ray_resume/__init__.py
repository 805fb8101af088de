"""Step-level resumable PyTorch training on Ray Train.

    from ray_resume import train
    result = train("configs/quickstart.yaml")            # or a dict, or a Config
    result.committed_iteration, result.checkpoint_path, result.metrics

    import ray_resume                                    # your own train_func (ray_resume.api)
    result = ray_resume.fit(train_func, checkpoint={...}, scaling={...})
    ck = ray_resume.get_checkpointer()                   # inside train_func, on every rank
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def train(config, *, build_model=None, loss=None, collate=None, address=None, overrides=()):
    """Run a job exactly as `python -m ray_resume.run` does and return its RunResult.

    `config` is a YAML path, a dict or a `ray_resume.config.Config`;
    `build_model(model_section) -> nn.Module`, `loss(model, batch) -> scalar`
    and `collate(arrays) -> batch` replace the config's import paths.
    """
    from .config import Config, load_config
    from .run import run

    if isinstance(config, (str, os.PathLike)):
        config = load_config(config, overrides)
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    return run(config, address, build_model=build_model, loss=loss, collate=collate)


def fit(train_func, **kwargs):
    """`ray_resume.api.fit`: your own Ray Train `train_func`, with ray_resume's checkpointing."""
    from .api import fit as _fit

    return _fit(train_func, **kwargs)


def get_checkpointer():
    """`ray_resume.api.get_checkpointer`: this rank's checkpointer, inside a train_func `fit` runs."""
    from .api import get_checkpointer as _get

    return _get()


def __getattr__(name: str):
    if name == "SampleStream":  # the built-in job's deterministic, resumable data cursor (ray_resume.data)
        from .data import SampleStream

        return SampleStream
    raise AttributeError(f"module 'ray_resume' has no attribute {name!r}")
