"""Typed, strict configuration for ray_resume.

A config is a YAML mapping validated into pydantic models: strictly (no bool for an integer,
no "2" for an integer, no key a section does not know) and *collecting*: every problem (unknown
key, wrong type, impossible value, cross-field conflict) is gathered and raised together as one
:class:`ConfigError`, each line naming the full dotted key and the source file.
"""

from ..errors import ConfigError
from .files import apply_overrides, json_schema, load_config
from .sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    FailureConfig,
    ModelConfig,
    ScalingConfig,
    StorageConfig,
    SyntheticDataConfig,
    TrainingConfig,
)
from .words import REDACTED, SECRET_STORAGE_KEYS, redacted

__all__ = [
    "Config",
    "ModelConfig",
    "DataConfig",
    "SyntheticDataConfig",
    "TrainingConfig",
    "ScalingConfig",
    "FailureConfig",
    "StorageConfig",
    "CheckpointConfig",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "json_schema",
    "redacted",
    "REDACTED",
    "SECRET_STORAGE_KEYS",
]
