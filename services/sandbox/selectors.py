"""Label and field selectors with kube-apiserver's syntax and errors (sandbox test/demo fixture)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .status import ApiError

Predicate = Callable[[Mapping[str, Any]], bool]

_SET_TERM = re.compile(r"^\s*([A-Za-z0-9._/-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([A-Za-z0-9._/-]+)\s*(==|=|!=)\s*([A-Za-z0-9._-]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*$")


def _split_terms(text: str) -> list[str]:
    """Split on commas outside parentheses (set terms carry commas inside)."""
    terms, depth, current = [], 0, []
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(char)
    terms.append("".join(current))
    return [t for t in terms if t.strip()]


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "=":
            return present and value == self.values[0]
        if self.operator == "!=":
            return not present or value != self.values[0]
        if self.operator == "in":
            return present and value in self.values
        if self.operator == "notin":
            return not present or value not in self.values
        if self.operator == "exists":
            return present
        return not present


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse `a=b,c!=d,e in (f,g),!h`; raise a 400 ApiError for anything else."""
    requirements: list[Requirement] = []
    for term in _split_terms(text or ""):
        if m := _SET_TERM.match(term):
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            requirements.append(Requirement(m.group(1), m.group(2), values))
        elif m := _EQ_TERM.match(term):
            requirements.append(Requirement(m.group(1), "!=" if m.group(2) == "!=" else "=", (m.group(3),)))
        elif m := _EXISTS_TERM.match(term):
            requirements.append(Requirement(m.group(2), "!" if m.group(1) else "exists"))
        else:
            raise ApiError(400, f"unable to parse requirement: {term.strip()!r}")
    return requirements


def labels_match(requirements: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    return all(r.matches(labels) for r in requirements)


def label_selector_object_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str] | None) -> bool:
    """Match a metav1.LabelSelector object (matchLabels + matchExpressions); empty matches all."""
    if not selector:
        return True
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    operators = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expression in selector.get("matchExpressions") or []:
        operator = operators.get(expression.get("operator", ""))
        if operator is None:
            raise ApiError(422, f"invalid label selector operator {expression.get('operator')!r}")
        if not Requirement(expression.get("key", ""), operator, tuple(expression.get("values") or ())).matches(labels):
            return False
    return True


# Which field paths each resource can be selected on, as the real apiserver allows.
FIELD_PATHS: dict[str, frozenset[str]] = {
    "pods": frozenset({"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase", "spec.schedulerName", "spec.restartPolicy", "status.podIP"}),
    "events": frozenset({
        "metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
        "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath",
        "reason", "reportingComponent", "source", "type",
    }),
}
_DEFAULT_FIELD_PATHS = frozenset({"metadata.name", "metadata.namespace"})


def field_value(obj: Mapping[str, Any], path: str) -> str:
    current: Any = obj
    for part in path.split("."):
        current = current.get(part) if isinstance(current, Mapping) else None
    if path == "source" and isinstance(current, Mapping):
        current = current.get("component")
    return "" if current is None else str(current)


def parse_field_selector(text: str | None, plural: str) -> list[tuple[str, bool, str]]:
    """Parse `spec.nodeName=n,status.phase!=Failed` into (path, equal, value) triples."""
    allowed = FIELD_PATHS.get(plural, _DEFAULT_FIELD_PATHS)
    terms = []
    for term in _split_terms(text or ""):
        m = re.match(r"^\s*([A-Za-z.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not m:
            raise ApiError(400, f"invalid field selector: {term.strip()!r}")
        if m.group(1) not in allowed:
            raise ApiError(400, f'field label not supported: {m.group(1)}')
        terms.append((m.group(1), m.group(2) != "!=", m.group(3)))
    return terms


def fields_match(terms: list[tuple[str, bool, str]], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, path) == value) == equal for path, equal, value in terms)
