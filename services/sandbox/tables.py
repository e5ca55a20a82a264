"""Server-side printing (`meta.k8s.io/v1` Table) so kubectl shows its usual columns (sandbox test/demo fixture)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .store import Obj

_NAME = {"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}
_AGE = {"name": "Age", "type": "string", "format": "", "description": "Age", "priority": 0}


def _column(name: str, priority: int = 0) -> dict[str, Any]:
    return {"name": name, "type": "string", "format": "", "description": name, "priority": priority}


def age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    try:
        seconds = int((datetime.now(timezone.utc) - datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)).total_seconds())
    except ValueError:
        return "<unknown>"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * 2 or (unit == "m" and seconds >= 120):
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _pod_cells(pod: Obj) -> list[Any]:
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    reason = status.get("phase", "Unknown")
    for s in statuses:
        terminated = (s.get("state") or {}).get("terminated")
        if terminated and status.get("phase") in ("Succeeded", "Failed"):
            reason = terminated.get("reason", reason)
    if pod["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    containers = len((pod.get("spec") or {}).get("containers") or [])
    return [f"{ready}/{containers}", reason, restarts, age(pod["metadata"].get("creationTimestamp")), status.get("podIP", "<none>"), (pod.get("spec") or {}).get("nodeName", "<none>")]


def _node_cells(node: Obj) -> list[Any]:
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    version = ((node.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", "")
    return ["Ready" if ready.get("status") == "True" else "NotReady", "<none>", age(node["metadata"].get("creationTimestamp")), version]


COLUMNS: dict[str, tuple[list[dict[str, Any]], Any]] = {
    "pods": ([_NAME, _column("Ready"), _column("Status"), _column("Restarts"), _AGE, _column("IP", 1), _column("Node", 1)], _pod_cells),
    "nodes": ([_NAME, _column("Status"), _column("Roles"), _AGE, _column("Version")], _node_cells),
    "namespaces": ([_NAME, _column("Status"), _AGE], lambda o: [(o.get("status") or {}).get("phase", ""), age(o["metadata"].get("creationTimestamp"))]),
    "configmaps": ([_NAME, _column("Data"), _AGE], lambda o: [len(o.get("data") or {}), age(o["metadata"].get("creationTimestamp"))]),
    "events": ([_column("Last Seen"), _column("Type"), _column("Reason"), _column("Object"), _column("Message")],
               lambda o: [age(o.get("lastTimestamp")), o.get("type", ""), o.get("reason", ""), f"{(o.get('involvedObject') or {}).get('kind', '').lower()}/{(o.get('involvedObject') or {}).get('name', '')}", o.get("message", "")]),
}


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def table(plural: str, objects: list[Obj], resource_version: str, include_object: str) -> Obj:
    definitions, cells = COLUMNS.get(plural, ([_NAME, _AGE], lambda o: [age(o["metadata"].get("creationTimestamp"))]))
    rows = []
    for obj in objects:
        row_cells = cells(obj) if plural == "events" else [obj["metadata"]["name"], *cells(obj)]
        rows.append({"cells": row_cells, "object": _row_object(obj, include_object)})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version}, "columnDefinitions": definitions, "rows": rows}


def _row_object(obj: Obj, include_object: str) -> Obj | None:
    if include_object == "None":
        return None
    if include_object == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
