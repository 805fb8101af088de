"""Config files: YAML read strictly, `--set dotted.key=value` overrides, and the JSON Schema for editors."""

from __future__ import annotations

import copy
import logging
import os
from typing import Iterable

import yaml

from ..errors import ConfigError
from .sections import Config
from .words import raise_if

logger = logging.getLogger("ray_resume.config")


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
            if node.get(part) is None:  # create absent/null optional blocks (e.g. data.synthetic)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {'.'.join(walked)} is not a mapping")
                break
        else:
            node[leaf] = value
    raise_if(problems)
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

    pydantic's, every section closed to keys it does not know (extra="forbid"), every key described
    by its comment above. The checks that span keys (a batch size the world sizes divide, an import
    path that imports) stay in `from_dict` and on the driver.
    """
    return Config.model_json_schema()
