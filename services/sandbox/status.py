"""Kubernetes `Status` errors as the sandbox API answers them (test/demo fixture)."""

from __future__ import annotations

from typing import Any

from kai_isolator.shared.errors import IsolatorError

REASONS = {
    400: "BadRequest", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed", 409: "Conflict",
    410: "Expired", 415: "UnsupportedMediaType", 422: "Invalid", 500: "InternalError", 504: "Timeout",
}


class ApiError(IsolatorError):
    """A request the sandbox refuses; becomes a `Status` body with the same code."""

    def __init__(self, code: int, message: str, *, reason: str | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def not_found(kind: str, name: str, group: str = "") -> ApiError:
    return ApiError(404, f'{kind} "{name}" not found', details={"name": name, "group": group, "kind": kind})


def already_exists(kind: str, name: str, group: str = "") -> ApiError:
    return ApiError(409, f'{kind} "{name}" already exists', reason="AlreadyExists", details={"name": name, "group": group, "kind": kind})


def conflict(kind: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        409, f'Operation cannot be fulfilled on {kind} "{name}": the object has been modified; please apply your changes to the latest version and try again',
        details={"name": name, "group": group, "kind": kind},
    )


def invalid(kind: str, name: str, message: str, group: str = "") -> ApiError:
    return ApiError(422, f'{kind} "{name}" is invalid: {message}', details={"name": name, "group": group, "kind": kind})


def expired(requested: int, oldest: int) -> ApiError:
    return ApiError(410, f"too old resource version: {requested} ({oldest})", reason="Expired")
