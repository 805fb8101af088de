"""docs/config.md, the configuration reference for people, written from the JSON Schema (`python -m
ray_resume.config reference`): every key of every section with its type, default, allowed values and
meaning, so the page cannot say what the code does not do. tests/test_doc_examples.py checks the
checked-in page against it."""

from __future__ import annotations

import json

from .files import json_schema
from .words import LOOKS

HEAD = """# Configuration reference

<!-- Written by `python -m ray_resume.config reference > docs/config.md` from ray_resume/config/sections.py;
     tests/test_doc_examples.py fails when this page and the schema differ. Edit the comments there, not here. -->

Every key a config file (or `ray_resume.fit(checkpoint=...)`) takes, section by section. Sections are
strict: an unknown key is refused with a "did you mean", a wrong type or an impossible value names the
full key, and the checks that span keys (a global batch the world sizes divide, an import path that
imports, a root that holds another run) run on the driver before Ray starts. `--set dotted.key=value`
overrides any key, its value read as YAML. The same schema for an editor:
`python -m ray_resume.config schema > ray_resume.schema.json`.
"""

_BOUNDS = {"minimum": "≥ {}", "exclusiveMinimum": "> {}", "maximum": "≤ {}", "exclusiveMaximum": "< {}"}
_PATTERNS = dict(
    zip(
        LOOKS,
        ("a name: `A-Z a-z 0-9 . _ -`", "`package.module:function`", "`torch.optim.SGD` or `package.module:Class`"),
    )
)


def markdown() -> str:
    """The whole page."""
    schema = json_schema()
    defs = schema["$defs"]
    out = [HEAD, "## Top level\n", *_table(schema, defs, "")]
    for key, node in _sections(schema, defs, ""):
        out += [
            f"\n## `{key}`\n",
            *([_one_line(node["description"]) + "\n"] if node.get("description") else []),
            *_table(node, defs, key + "."),
        ]
    return "\n".join(out) + "\n"


def _sections(node: dict, defs: dict, prefix: str):
    """(dotted key, schema) of every section under `node`, depth first, in the schema's order."""
    for key, prop in node["properties"].items():
        if ref := _ref(prop):
            yield prefix + key, defs[ref]
            yield from _sections(defs[ref], defs, prefix + key + ".")


def _table(node: dict, defs: dict, prefix: str) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, prop in node["properties"].items():
        ref = _ref(prop)
        default = (
            "required" if key in node.get("required", ()) else "" if ref else f"`{json.dumps(prop.get('default'))}`"
        )
        kind = f"[section](#{(prefix + key).replace('.', '')})" if ref else _type(prop)
        if ref and any(option.get("type") == "null" for option in prop.get("anyOf", ())):
            kind += ", or `null`" + (" (the default)" if prop.get("default") is None else "")
        rows.append(f"| `{prefix}{key}` | {kind} | {default} | {_one_line(prop.get('description', ''))} |")
    return rows


def _ref(prop: dict) -> str | None:
    for option in [prop, *prop.get("anyOf", ())]:
        if "$ref" in option:
            return option["$ref"].rsplit("/", 1)[-1]
    return None


def _type(prop: dict) -> str:
    if "anyOf" in prop:
        return " or ".join(_type(option) for option in prop["anyOf"])
    if "enum" in prop:
        return " \\| ".join(f"`{json.dumps(v).strip(chr(34))}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    kind = {"integer": "integer", "number": "number", "boolean": "boolean", "string": "string", "null": "`null`"}.get(
        prop.get("type"), ""
    )
    if prop.get("type") == "array":
        kind = "list of " + _type(prop.get("items", {}))
    elif prop.get("type") == "object":
        values = prop.get("additionalProperties")
        kind = "mapping" + (f" of {_type(values)}" if isinstance(values, dict) and values else "")
    limits = [text.format(prop[bound]) for bound, text in _BOUNDS.items() if bound in prop]
    if "pattern" in prop:
        limits.append(_PATTERNS.get(prop["pattern"], f"matching `{prop['pattern']}`"))
    if prop.get("minLength"):
        limits.append("non-empty")
    return kind + (f" ({', '.join(limits)})" if limits else "")


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
