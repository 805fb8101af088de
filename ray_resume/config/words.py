"""pydantic's validation errors in our words: one line per problem, each naming its full dotted
key, with a "did you mean" for an unknown one; a credential's value is never shown."""

from __future__ import annotations

import copy
import difflib
import re
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel

from ..errors import ConfigError


def raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


# {pattern: what an error says a key of it must do}; the patterns land in the JSON Schema too.
LOOKS = {
    r"^[A-Za-z0-9._-]+$": "be non-empty and use only [A-Za-z0-9._-]",
    r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?$": "look like 'package.module:function'",
    r"^[A-Za-z_][\w.]*[.:][A-Za-z_]\w*$": "look like 'torch.optim.SGD' or 'package.module:Class'",
}
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


_WANTS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "list_type": "a list",
}
_KIND = {int: "int_type", str: "string_type"}  # the required keys' types, for "is required (an integer)"
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_UNKNOWN = ("extra_forbidden", "invalid_key")  # invalid_key: one that is not a string


def _section_of(tp: Any) -> Optional[type]:
    """The section class a key of type ``tp`` (or Optional[tp]) holds, if any."""
    return next((a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _sections(cls: type, at: str = ""):
    yield at, cls
    for name, f in cls.model_fields.items():
        if sub := _section_of(f.annotation):
            yield from _sections(sub, f"{at}{name}.")


def key_of(root: type, section: type) -> str:
    """Where `section` sits in the config `root`: "" for the root, "checkpoint.storage." for that section."""
    return next(at for at, cls in _sections(root) if cls is section)


def got(value: Any, key: str = "") -> str:
    """What a wrong value was, for an error message; a credential's value is never shown."""
    if key.rsplit(".", 1)[-1] in SECRET_STORAGE_KEYS:
        return f"got {type(value).__name__} {REDACTED}"
    return f"got {type(value).__name__} {value!r}"


def problems(errors: list[dict], root: type, at: str = "") -> list[str]:
    """One line per problem from pydantic's errors, each naming its full dotted key (``at`` + loc).

    Unknown keys first (pydantic puts them last): a typo explains what follows from it, as
    save_pth does "save_path must be set"."""
    errors = sorted(errors, key=lambda err: err["type"] not in _UNKNOWN)
    sections = dict(_sections(root))
    return [p for err in errors for p in _say(err, at, sections)]


def _say(err: dict, at: str, sections: dict[str, type]) -> list[str]:
    kind, loc, value, ctx = err["type"], err["loc"], err.get("input"), err.get("ctx", {})
    if kind == "value_error":  # our own checks, which name their keys in full
        return ctx["error"].problems
    where = at + "".join(f"{part}." for part in loc[:-1])
    key = where + str(loc[-1])
    if kind in _UNKNOWN:
        known = list(sections[where].model_fields)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        return [
            f"{key}: unknown key" + (f"; did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(known)})")
        ]
    if kind in ("missing", "literal_error"):
        tp = sections[where].model_fields[loc[-1]].annotation
        wants = "one of " + ", ".join(typing.get_args(tp)) if typing.get_origin(tp) is Literal else _WANTS[_KIND[tp]]
        return [f"{key} is required ({wants})" if kind == "missing" else f"{key} must be {wants}; got {value!r}"]
    if kind == "string_pattern_mismatch":
        return [f"{key} must {LOOKS[ctx['pattern']]}, got {value!r}"]
    if kind == "string_too_short":
        return [f"{key} must be a non-empty string"]
    if bound := ctx.keys() & _BOUNDS.keys():
        (op,) = bound
        return [f"{key} must be {_BOUNDS[op]} {ctx[op]:g}, got {value!r}"]
    if kind in _WANTS:
        return [f"{key} must be {_WANTS[kind]}, {got(value, key)}"]
    return [f"{key}: {err['msg']}"]


def mentions(problem: str, key: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", problem) is not None


def passed(cls: type, raw: Any, failed: list[tuple]) -> Any:
    """``cls`` built, unvalidated, from the keys of ``raw`` that passed; the failed ones keep their defaults."""
    raw = raw if isinstance(raw, dict) else {}
    values = {}
    for name, f in cls.model_fields.items():
        below = [loc[1:] for loc in failed if loc[:1] == (name,)]
        sub = _section_of(f.annotation)
        if sub and (raw.get(name) is not None or f.default is not None):  # not an Optional one left out
            values[name] = passed(sub, raw.get(name), below)
        elif name in raw and not below:
            values[name] = raw[name]
    return cls.model_construct(**values)
