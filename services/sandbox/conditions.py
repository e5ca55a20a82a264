"""`matchConditions` for the sandbox's webhooks: a small CEL subset over labels and annotations (test/demo fixture).

Supported: `'key' in object.metadata.annotations`, `object.metadata.labels['k'] == 'v'`,
`!=`, `has(object.metadata.annotations)`, `true`/`false`, `!`, `&&`, `||` and parentheses.
Anything else is refused when the configuration is created, as a CEL compile error would be.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"\s*(?:(?P<string>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")|(?P<op>==|!=|&&|\|\||[!()\[\].])|(?P<ident>[A-Za-z_][A-Za-z0-9_]*))")


class ConditionError(ValueError):
    """The expression is outside the supported subset, or cannot be evaluated on this object."""


@dataclass(frozen=True)
class _Path:
    parts: tuple[str, ...]

    def resolve(self, variables: dict[str, Any]) -> Any:
        current: Any = variables
        for part in self.parts:
            if not isinstance(current, dict) or part not in current:
                raise ConditionError(f"no such key: {part}")
            current = current[part]
        return current


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(text):
        if text[position:].strip() == "":
            break
        match = _TOKEN.match(text, position)
        if not match:
            raise ConditionError(f"unsupported syntax at {text[position:]!r}")
        kind = match.lastgroup or ""
        value = match.group(kind)
        if kind == "string":
            value = bytes(value[1:-1], "utf-8").decode("unicode_escape")
        tokens.append((kind, value))
        position = match.end()
    return tokens


class Condition:
    """A compiled expression; `evaluate(object)` returns a bool or raises ConditionError."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        self._tokens = _tokenize(expression)
        self._at = 0
        self._tree = self._or()
        if self._at != len(self._tokens):
            raise ConditionError(f"unexpected {self._tokens[self._at][1]!r} in {expression!r}")

    # Parsing builds nested tuples; evaluation walks them.
    def _peek(self) -> tuple[str, str] | None:
        return self._tokens[self._at] if self._at < len(self._tokens) else None

    def _take(self, value: str | None = None) -> tuple[str, str]:
        token = self._peek()
        if token is None or (value is not None and token[1] != value):
            raise ConditionError(f"expected {value or 'more'} in {self.expression!r}")
        self._at += 1
        return token

    def _or(self) -> Any:
        node = self._and()
        while self._peek() == ("op", "||"):
            self._take()
            node = ("or", node, self._and())
        return node

    def _and(self) -> Any:
        node = self._unary()
        while self._peek() == ("op", "&&"):
            self._take()
            node = ("and", node, self._unary())
        return node

    def _unary(self) -> Any:
        if self._peek() == ("op", "!"):
            self._take()
            return ("not", self._unary())
        if self._peek() == ("op", "("):
            self._take()
            node = self._or()
            self._take(")")
            return node
        if self._peek() == ("ident", "has"):
            self._take()
            self._take("(")
            path = self._path()
            self._take(")")
            return ("has", path)
        left = self._operand()
        token = self._peek()
        if token in (("op", "=="), ("op", "!=")):
            self._take()
            return ("eq" if token[1] == "==" else "ne", left, self._operand())
        if token == ("ident", "in"):
            self._take()
            return ("in", left, self._path())
        return ("truth", left)

    def _operand(self) -> Any:
        token = self._peek()
        if token is None:
            raise ConditionError(f"incomplete expression {self.expression!r}")
        if token[0] == "string":
            self._take()
            return ("lit", token[1])
        if token in (("ident", "true"), ("ident", "false")):
            self._take()
            return ("lit", token[1] == "true")
        return self._path()

    def _path(self) -> _Path:
        kind, root = self._take()
        if kind != "ident" or root != "object":
            raise ConditionError(f"only paths under 'object' are supported, got {root!r}")
        parts: list[str] = []
        while self._peek() in (("op", "."), ("op", "[")):
            if self._take()[1] == ".":
                kind, name = self._take()
                if kind != "ident":
                    raise ConditionError(f"expected a field name after '.' in {self.expression!r}")
                parts.append(name)
            else:
                kind, key = self._take()
                if kind != "string":
                    raise ConditionError(f"only string keys are supported in [] in {self.expression!r}")
                parts.append(key)
                self._take("]")
        return _Path(("object", *parts))

    def evaluate(self, obj: dict[str, Any]) -> bool:
        result = self._eval(self._tree, {"object": obj})
        if not isinstance(result, bool):
            raise ConditionError(f"{self.expression!r} does not evaluate to a bool")
        return result

    def _eval(self, node: Any, variables: dict[str, Any]) -> Any:
        if isinstance(node, _Path):
            return node.resolve(variables)
        op = node[0]
        if op == "lit":
            return node[1]
        if op == "or":
            return self._eval(node[1], variables) is True or self._eval(node[2], variables) is True
        if op == "and":
            return self._eval(node[1], variables) is True and self._eval(node[2], variables) is True
        if op == "not":
            return not self._eval(node[1], variables)
        if op == "has":
            try:
                node[1].resolve(variables)
            except ConditionError:
                return False
            return True
        if op in ("eq", "ne"):
            equal = self._eval(node[1], variables) == self._eval(node[2], variables)
            return equal if op == "eq" else not equal
        if op == "in":
            container = node[2].resolve(variables)
            if not isinstance(container, (dict, list)):
                raise ConditionError("'in' needs a map or a list")
            return self._eval(node[1], variables) in container
        return self._eval(node[1], variables)
