"""Which changes to an event type's JSON Schema break a subscriber built on an earlier release of it.

Breaking: a removed event type or field, a retyped field, a newly required field, an enumeration value removed or
a field that loses or gains its enumeration. Not breaking: new optional fields, new event types, new enumeration
values, descriptions and defaults, and anything in a type whose version changed (`.v1` -> `.v2` is a new type).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Schema = dict[str, Any]
_VERSION = re.compile(r"^(?P<family>.+)\.v(?P<number>\d+)$")


def breaking_changes(released: dict[str, Schema], current: dict[str, Schema]) -> list[str]:
    """Every break between two sets of schemas keyed by event type, as readable lines."""
    problems: list[str] = []
    for event_type, old in sorted(released.items()):
        new = current.get(event_type)
        if new is None:
            if not _superseded(event_type, current):
                problems.append(f"{event_type}: event type removed (publish it until subscribers moved to a new version)")
            continue
        problems += [f"{event_type}: {p}" for p in _compare(old, new, old, new, "", set())]
    return problems


def load_schemas(directory: Path) -> dict[str, Schema]:
    """`<type>.json` files of a directory, keyed by type."""
    return {path.name.removesuffix(".json"): json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def latest_release(released_root: Path) -> Path | None:
    """The kept schemas of the highest released version under `released_root` (`<version>/<type>.json`)."""
    versions = [p for p in released_root.iterdir() if p.is_dir()] if released_root.is_dir() else []
    return max(versions, key=lambda p: tuple(int(n) if n.isdigit() else 0 for n in re.split(r"[.-]", p.name)), default=None)


def _superseded(event_type: str, current: dict[str, Schema]) -> bool:
    match = _VERSION.match(event_type)
    if not match:
        return False
    for other in current:
        found = _VERSION.match(other)
        if found and found["family"] == match["family"] and int(found["number"]) > int(match["number"]):
            return True
    return False


def _compare(old: Schema, new: Schema, old_root: Schema, new_root: Schema, where: str, seen: set[tuple[str, str]]) -> list[str]:
    refs = (old.get("$ref", ""), new.get("$ref", ""))
    if all(refs):
        if refs in seen:
            return []  # a recursive model: this pair of definitions is already being compared
        seen = seen | {refs}
    old, new = _resolve(old, old_root), _resolve(new, new_root)
    label = where or "(message)"
    old_alts = {_kind(s): s for s in _alternatives(old, old_root)}
    new_alts = {_kind(s): s for s in _alternatives(new, new_root)}
    if old_alts.keys() != new_alts.keys():
        return [f"{label}: type changed from {_describe(old_alts)} to {_describe(new_alts)}"]
    problems: list[str] = []
    for kind, old_alt in old_alts.items():
        new_alt = new_alts[kind]
        if kind[1]:  # an enumeration
            removed = [v for v in _values(old_alt) if v not in _values(new_alt)]
            if removed:
                problems.append(f"{label}: enumeration value(s) {', '.join(map(json.dumps, removed))} removed")
        if kind[0] == "object":
            problems += _compare_objects(old_alt, new_alt, old_root, new_root, where, seen)
        elif kind[0] == "array" and ("items" in old_alt or "items" in new_alt):
            problems += _compare(old_alt.get("items", {}), new_alt.get("items", {}), old_root, new_root, f"{where}[]", seen)
    return problems


def _compare_objects(old: Schema, new: Schema, old_root: Schema, new_root: Schema, where: str, seen: set[tuple[str, str]]) -> list[str]:
    problems = []
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    old_required, new_required = set(old.get("required", [])), set(new.get("required", []))
    for name, old_prop in old_props.items():
        path = f"{where}.{name}" if where else name
        if name not in new_props:
            problems.append(f"{path}: field removed")
            continue
        problems += _compare(old_prop, new_props[name], old_root, new_root, path, seen)
    for name in sorted(new_required - old_required):
        path = f"{where}.{name}" if where else name
        problems.append(f"{path}: {'new field is required' if name not in old_props else 'field became required'}")
    return problems


def _resolve(schema: Schema, root: Schema) -> Schema:
    """Follow local `$ref`s and merge `allOf` parts, so two spellings of one shape compare equal."""
    while "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **target}
    if "allOf" in schema:
        merged: Schema = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged = _merge(merged, _resolve(part, root))
        schema = merged
    return schema


def _merge(a: Schema, b: Schema) -> Schema:
    merged = dict(a)
    for key, value in b.items():
        if key == "properties":
            props = dict(merged.get("properties", {}))
            for name, prop in value.items():
                props[name] = {**props.get(name, {}), **prop}
            merged["properties"] = props
        elif key == "required":
            merged["required"] = sorted(set(merged.get("required", [])) | set(value))
        else:
            merged[key] = value
    return merged


def _alternatives(schema: Schema, root: Schema) -> list[Schema]:
    """The shapes a value may take: the members of anyOf/oneOf, and each JSON type of a type list."""
    for key in ("anyOf", "oneOf"):
        if key in schema:
            base = {k: v for k, v in schema.items() if k != key}
            return [alt for member in schema[key] for alt in _alternatives(_resolve({**base, **member}, root), root)]
    types = schema.get("type")
    if isinstance(types, list):
        return [{**schema, "type": t} for t in types]
    return [schema]


def _kind(schema: Schema) -> tuple[str, bool, str]:
    """(JSON type, restricted to listed values, string format): two shapes of the same kind are compared further."""
    enumerated = "enum" in schema or "const" in schema
    json_type = schema.get("type")
    if json_type is None and enumerated:
        json_type = _json_type(_values(schema)[0]) if _values(schema) else "null"
    if json_type is None:
        json_type = "object" if "properties" in schema else "array" if "items" in schema else "any"
    return str(json_type), enumerated, str(schema.get("format", ""))


def _values(schema: Schema) -> list[Any]:
    return [schema["const"]] if "const" in schema else list(schema.get("enum", []))


def _json_type(value: Any) -> str:
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(value, python_type):
            return name
    return "null"


def _describe(alternatives: dict[tuple[str, bool, str], Schema]) -> str:
    def one(kind: tuple[str, bool, str]) -> str:
        text = kind[0] + (f" ({kind[2]})" if kind[2] else "")
        return f"{text} enum {json.dumps(_values(alternatives[kind]))}" if kind[1] else text

    return " | ".join(sorted(one(k) for k in alternatives))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kai_isolator.shared.event_compat", description=__doc__)
    parser.add_argument("released", type=Path, help="a release's kept schemas, e.g. docs/events/released/0.1.0")
    parser.add_argument("current", type=Path, help="the current schemas, e.g. docs/events/schemas")
    args = parser.parse_args(argv)
    problems = breaking_changes(load_schemas(args.released), load_schemas(args.current))
    for problem in problems:
        print(problem)
    print(f"{len(problems)} breaking change(s) from {args.released} to {args.current}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
