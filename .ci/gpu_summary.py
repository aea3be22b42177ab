"""The schema of .ci/gpu's summary.json (.ci/gpu_summary.schema.json, JSON Schema draft 7) and a checker for the
part of JSON Schema it uses (type, enum, required, properties, items, maxItems, minimum, $ref, allOf), so that the
script validates its own output on a machine without the jsonschema package. Standard library only."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA_PATH = Path(__file__).resolve().with_name("gpu_summary.schema.json")
SCHEMA_ID = "gpucoll-ci-gpu/1"

_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int, "boolean": bool,
          "null": type(None)}


def _is(value, name: str) -> bool:
    if name in ("number", "integer") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def _check(value, schema: dict, root: dict, path: str, out: list) -> None:
    if "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        _check(value, node, root, path, out)
    for sub in schema.get("allOf", []):
        _check(value, sub, root, path, out)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            out.append(f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__}")
            return
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        out.append(f"{path}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"{path}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, root, f"{path}.{key}", out)
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: {len(value)} items, at most {schema['maxItems']}")
        if "items" in schema:
            for i, item in enumerate(value):
                _check(item, schema["items"], root, f"{path}[{i}]", out)


def validate(summary: dict, schema: dict | None = None) -> list:
    """Every way `summary` breaks the schema, one sentence each ([] when it matches)."""
    schema = json.loads(SCHEMA_PATH.read_text()) if schema is None else schema
    out = []
    _check(summary, schema, schema, "summary", out)
    return out


if __name__ == "__main__":
    import sys

    found = validate(json.loads(Path(sys.argv[1]).read_text()))
    print("\n".join(found) or "valid")
    sys.exit(1 if found else 0)
