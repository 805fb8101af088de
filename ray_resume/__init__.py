"""Step-level resumable PyTorch training on Ray Train.

    from ray_resume import train
    result = train("configs/quickstart.yaml")            # or a dict, or a Config
    result.committed_iteration, result.checkpoint_path, result.metrics
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
