"""JSON patch (RFC 6902), merge patch (RFC 7386) and strategic merge for maps (sandbox test/demo fixture)."""

from __future__ import annotations

import copy
from typing import Any

from .status import ApiError

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}: must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if for_add and token == "-":
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise ApiError(422, f"invalid array index {token!r}")
    index = int(token)
    if index > len(container) or (not for_add and index == len(container)):
        raise ApiError(422, f"array index {index} out of range")
    return index


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    current = doc
    for token in tokens[:-1]:
        if isinstance(current, dict) and token in current:
            current = current[token]
        elif isinstance(current, list):
            current = current[_index(current, token, for_add=False)]
        else:
            raise ApiError(422, f"doc is missing path: {path!r}")
    return current


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict) and tokens[-1] in parent:
        return parent[tokens[-1]]
    if isinstance(parent, list):
        return parent[_index(parent, tokens[-1], for_add=False)]
    raise ApiError(422, f"doc is missing path: {path!r}")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        parent[tokens[-1]] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, tokens[-1], for_add=True), value)
    else:
        raise ApiError(422, f"doc is missing path: {path!r}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        raise ApiError(422, "cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict) and tokens[-1] in parent:
        del parent[tokens[-1]]
    elif isinstance(parent, list):
        del parent[_index(parent, tokens[-1], for_add=False)]
    else:
        raise ApiError(422, f"doc is missing path: {path!r}")
    return doc


def apply_json_patch(doc: dict[str, Any], operations: Any) -> dict[str, Any]:
    """Apply RFC 6902 operations to a copy of `doc`; any bad operation rejects the whole patch."""
    if not isinstance(operations, list):
        raise ApiError(400, "a JSON patch must be a list of operations")
    result: Any = copy.deepcopy(doc)
    for number, op in enumerate(operations):
        if not isinstance(op, dict) or not isinstance(op.get("path"), str):
            raise ApiError(400, f"JSON patch operation {number} needs an 'op' and a string 'path'")
        kind, path = op.get("op"), op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise ApiError(400, f"JSON patch operation {number} ({kind}) needs a 'value'")
        if kind == "add":
            result = _add(result, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            result = _remove(result, path)
        elif kind == "replace":
            _get(result, path)
            result = _add(_remove(result, path), path, copy.deepcopy(op["value"])) if _pointer(path) else copy.deepcopy(op["value"])
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise ApiError(400, f"JSON patch operation {number} ({kind}) needs a string 'from'")
            value = copy.deepcopy(_get(result, source))
            if kind == "move":
                result = _remove(result, source)
            result = _add(result, path, value)
        elif kind == "test":
            if _get(result, path) != op["value"]:
                raise ApiError(422, f"JSON patch test failed at {path!r}")
        else:
            raise ApiError(400, f"unknown JSON patch operation {kind!r}")
    if not isinstance(result, dict):
        raise ApiError(422, "a patch must leave an object")
    return result


def apply_merge_patch(doc: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


_ORDER_ONLY_DIRECTIVES = ("$setElementOrder/",)


def apply_strategic_merge_patch(doc: dict[str, Any], patch: Any) -> dict[str, Any]:
    """Strategic merge for maps (metadata, labels, annotations): merge-patch semantics.

    List merge keys are not modelled, so directives that would need them are refused
    rather than applied wrongly; `$setElementOrder` only orders and is dropped.
    """
    if not isinstance(patch, dict):
        raise ApiError(400, "a strategic merge patch must be a JSON object")
    return apply_merge_patch(doc, _strip_directives(patch))


def _strip_directives(patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    cleaned = {}
    for key, value in patch.items():
        if key.startswith(_ORDER_ONLY_DIRECTIVES):
            continue
        if key.startswith("$"):
            raise ApiError(422, f"the sandbox API does not support strategic merge directive {key!r}; use a JSON patch")
        cleaned[key] = _strip_directives(value)
    return cleaned


def apply_patch(doc: dict[str, Any], content_type: str, patch: Any) -> dict[str, Any]:
    media = content_type.split(";")[0].strip().lower()
    if media == JSON_PATCH:
        return apply_json_patch(doc, patch)
    if media == MERGE_PATCH:
        if not isinstance(patch, dict):
            raise ApiError(400, "a merge patch must be a JSON object")
        return apply_merge_patch(doc, patch)
    if media == STRATEGIC_MERGE_PATCH:
        return apply_strategic_merge_patch(doc, patch)
    raise ApiError(415, f"the sandbox API does not support patch type {media!r}; use one of {', '.join(PATCH_TYPES)}")
