"""The sandbox API's object store: one resourceVersion counter, a retained change window, watches.

A test and demo fixture. Mutations are synchronous, so a watch registers and replays its
backlog atomically with respect to writes: no change can slip between list and watch.
"""

from __future__ import annotations

import asyncio
import copy
import re
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .selectors import Requirement, fields_match, labels_match, parse_field_selector, parse_label_selector
from .status import ApiError, already_exists, conflict, expired, invalid, not_found

Obj = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """One served resource type and how discovery describes it."""

    plural: str
    kind: str
    group: str
    version: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    singular: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How kube-apiserver names the resource in messages: `pods`, `mutatingwebhookconfigurations.admissionregistration.k8s.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES: tuple[Resource, ...] = (
    Resource("pods", "Pod", "", "v1", True, ("po",), "pod"),
    Resource("namespaces", "Namespace", "", "v1", False, ("ns",), "namespace"),
    Resource("nodes", "Node", "", "v1", False, ("no",), "node"),
    Resource("configmaps", "ConfigMap", "", "v1", True, ("cm",), "configmap"),
    Resource("events", "Event", "", "v1", True, ("ev",), "event"),
    Resource("mutatingwebhookconfigurations", "MutatingWebhookConfiguration", "admissionregistration.k8s.io", "v1", False, (), "mutatingwebhookconfiguration"),
)
BY_PLURAL = {r.plural: r for r in RESOURCES}

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Change:
    """One write, as every watch sees it before its own selector is applied."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    plural: str
    obj: Obj
    old: Obj | None = None


@dataclass
class WatchStream:
    """One open watch: its filter and the events waiting to be written to it."""

    plural: str
    namespace: str | None
    labels: list[Requirement]
    fields: list[tuple[str, bool, str]]
    queue: asyncio.Queue[tuple[str, Obj] | None] = field(default_factory=asyncio.Queue)

    def matches(self, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return labels_match(self.labels, meta.get("labels")) and fields_match(self.fields, obj)

    def offer(self, change: Change) -> None:
        """Queue what this watch should see: objects moving in or out of its selector arrive as ADDED / DELETED."""
        if change.plural != self.plural:
            return
        now = self.matches(change.obj)
        if change.type == "MODIFIED" and change.old is not None:
            before = self.matches(change.old)
            kind = "MODIFIED" if before and now else "ADDED" if now else "DELETED" if before else None
        else:
            kind = change.type if now else None
        if kind:
            self.queue.put_nowait((kind, change.obj))


Validator = Callable[[Obj], None]


class Store:
    """Every object the sandbox holds, and the history watches replay from."""

    def __init__(self, retained_events: int = 1000) -> None:
        if retained_events < 1:
            raise ValueError("retained_events must be at least 1")
        self.rv = 0
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {r.plural: {} for r in RESOURCES}
        self._history: deque[Change] = deque(maxlen=retained_events)
        self._compacted_rv = 0
        self._watches: list[WatchStream] = []
        self.validators: dict[str, list[Validator]] = {}
        for name in ("default", "kube-system", "kube-public"):
            self.create("namespaces", {"metadata": {"name": name}})

    # --- reading ------------------------------------------------------------------------

    def get(self, plural: str, namespace: str | None, name: str) -> Obj:
        resource = BY_PLURAL[plural]
        obj = self._objects[plural].get(((namespace or "") if resource.namespaced else "", name))
        if obj is None:
            raise not_found(resource.qualified, name, resource.group)
        return obj

    def list(self, plural: str, namespace: str | None = None, label_selector: str | None = None, field_selector: str | None = None) -> tuple[list[Obj], int]:
        labels = parse_label_selector(label_selector)
        fields = parse_field_selector(field_selector, plural)
        probe = WatchStream(plural, namespace, labels, fields)
        items = [o for o in self._objects[plural].values() if probe.matches(o)]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items, self.rv

    @property
    def oldest_watchable_rv(self) -> int:
        return self._compacted_rv

    # --- writing ------------------------------------------------------------------------

    def prepare(self, plural: str, body: Obj, namespace: str | None = None) -> Obj:
        """The object as admission sees it: defaulted and namespaced, but not yet named from generateName or given a uid."""
        resource = BY_PLURAL[plural]
        if not isinstance(body, dict):
            raise ApiError(400, f"the body of a {resource.kind} must be a JSON object")
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "metadata must be an object")
        if resource.namespaced:
            meta["namespace"] = self._namespace_for(resource, meta, namespace)
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and not meta.get("generateName"):
            raise invalid(resource.kind, "", "metadata.name: Required value: name or generateName is required", resource.group)
        for transient in ("resourceVersion", "deletionTimestamp", "uid", "creationTimestamp"):
            meta.pop(transient, None)
        _defaults(plural, obj)
        return obj

    def create(self, plural: str, body: Obj, namespace: str | None = None, *, dry_run: bool = False) -> Obj:
        resource = BY_PLURAL[plural]
        obj = self.prepare(plural, body, namespace)
        meta = obj["metadata"]
        namespace = meta.get("namespace", "")
        name = meta.get("name") or self._generated_name(plural, namespace, str(meta["generateName"]))
        self._check_name(resource, name)
        if (namespace, name) in self._objects[plural]:
            raise already_exists(resource.qualified, name, resource.group)
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=now_iso())
        for validate in self.validators.get(plural, []):
            validate(obj)
        if dry_run:
            return obj
        return self._commit("ADDED", plural, (namespace, name), obj, None)

    def update(self, plural: str, namespace: str | None, name: str, new: Obj, *, allow_spec_change: bool = False, dry_run: bool = False) -> Obj:
        """Replace an object; a stale `metadata.resourceVersion` in `new` is a 409 conflict."""
        resource = BY_PLURAL[plural]
        old = self.get(plural, namespace, name)
        if not isinstance(new, dict) or not isinstance(new.get("metadata", {}), dict):
            raise ApiError(400, f"the body of a {resource.kind} must be a JSON object with object metadata")
        obj = copy.deepcopy(new)
        meta = obj.setdefault("metadata", {})
        stated = meta.get("resourceVersion")
        if stated not in (None, "") and str(stated) != old["metadata"]["resourceVersion"]:
            raise conflict(resource.qualified, name, resource.group)
        for immutable in ("name", "namespace", "uid"):
            if immutable in meta and meta[immutable] != old["metadata"].get(immutable):
                raise invalid(resource.kind, name, f"metadata.{immutable}: Invalid value: field is immutable", resource.group)
        meta.update({k: old["metadata"][k] for k in ("name", "namespace", "uid", "creationTimestamp") if k in old["metadata"]})
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        if plural == "pods" and not allow_spec_change and obj.get("spec") != old.get("spec"):
            raise invalid("Pod", name, "spec: Forbidden: pod updates may not change fields other than metadata (the sandbox models only metadata and status updates)")
        for validate in self.validators.get(plural, []):
            validate(obj)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if obj == old or dry_run:
            return old if obj == old else obj
        key = (old["metadata"].get("namespace", ""), name)
        return self._commit("MODIFIED", plural, key, obj, old)

    def delete(self, plural: str, namespace: str | None, name: str, *, dry_run: bool = False) -> Obj:
        resource = BY_PLURAL[plural]
        old = self.get(plural, namespace, name)
        if dry_run:
            return old
        if plural == "namespaces":
            for inner in (r for r in RESOURCES if r.namespaced):
                for (ns, inner_name) in [k for k in self._objects[inner.plural] if k[0] == name]:
                    self.delete(inner.plural, ns, inner_name)
        gone = copy.deepcopy(old)
        gone["metadata"]["deletionTimestamp"] = now_iso()
        key = (old["metadata"].get("namespace", "") if resource.namespaced else "", name)
        return self._commit("DELETED", plural, key, gone, old)

    def _commit(self, kind: str, plural: str, key: tuple[str, str], obj: Obj, old: Obj | None) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            del self._objects[plural][key]
        else:
            self._objects[plural][key] = obj
        if len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        change = Change(self.rv, kind, plural, obj, old)
        self._history.append(change)
        for stream in self._watches:
            stream.offer(change)
        return obj

    def compact(self) -> None:
        """Forget all history, as etcd compaction does: older versions now answer 410 Gone."""
        self._history.clear()
        self._compacted_rv = self.rv

    # --- watching -----------------------------------------------------------------------

    def watch(self, plural: str, namespace: str | None, label_selector: str | None, field_selector: str | None, resource_version: str | None) -> WatchStream:
        """Open a watch; events after `resource_version` (or the current state, when unset or "0") are queued at once."""
        stream = WatchStream(plural, namespace, parse_label_selector(label_selector), parse_field_selector(field_selector, plural))
        if resource_version in (None, "", "0"):
            items = sorted((o for o in self._objects[plural].values() if stream.matches(o)), key=lambda o: int(o["metadata"]["resourceVersion"]))
            for obj in items:
                stream.queue.put_nowait(("ADDED", obj))
        else:
            since = parse_resource_version(resource_version)
            if since < self._compacted_rv:
                raise expired(since, self._compacted_rv + 1)
            for change in self._history:
                if change.rv > since:
                    stream.offer(change)
        self._watches.append(stream)
        return stream

    def unwatch(self, stream: WatchStream) -> None:
        if stream in self._watches:
            self._watches.remove(stream)

    def close_watches(self) -> None:
        for stream in self._watches:
            stream.queue.put_nowait(None)
        self._watches.clear()

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    # --- helpers ------------------------------------------------------------------------

    def _namespace_for(self, resource: Resource, meta: Obj, namespace: str | None) -> str:
        if not resource.namespaced:
            meta.pop("namespace", None)
            return ""
        stated = meta.get("namespace")
        if namespace and stated and stated != namespace:
            raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the request")
        namespace = namespace or stated or "default"
        if ("", namespace) not in self._objects["namespaces"]:
            raise not_found("namespaces", namespace)
        return namespace

    def _generated_name(self, plural: str, namespace: str, prefix: str) -> str:
        for _ in range(20):
            candidate = prefix + "".join(_SUFFIX_ALPHABET[b % len(_SUFFIX_ALPHABET)] for b in uuid.uuid4().bytes[:5])
            if (namespace, candidate) not in self._objects[plural]:
                return candidate
        raise ApiError(500, f"could not generate a unique name from {prefix!r}")

    @staticmethod
    def _check_name(resource: Resource, name: str) -> None:
        if not name:
            raise invalid(resource.kind, "", "metadata.name: Required value: name or generateName is required", resource.group)
        pattern = _DNS_LABEL if resource.plural == "namespaces" else _DNS_SUBDOMAIN
        limit = 63 if resource.plural == "namespaces" else 253
        if len(name) > limit or not pattern.match(name):
            raise invalid(resource.kind, name, f"metadata.name: Invalid value: {name!r}: must be a lowercase RFC 1123 {'label' if limit == 63 else 'subdomain'}", resource.group)


def parse_resource_version(value: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"invalid resource version {value!r}: must be a decimal number issued by this server") from None
    if number < 0:
        raise ApiError(400, f"invalid resource version {value!r}")
    return number


def _defaults(plural: str, obj: Obj) -> None:
    """The few defaults the apiserver adds that clients and the node simulator rely on."""
    if plural == "namespaces":
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        obj["status"] = {"phase": "Active"}
    elif plural == "pods":
        spec = obj.get("spec")
        if not isinstance(spec, dict) or not isinstance(spec.get("containers"), list) or not spec["containers"]:
            raise invalid("Pod", obj["metadata"]["name"], "spec.containers: Required value")
        for number, container in enumerate(_containers(spec)):
            if not isinstance(container, dict) or not container.get("name") or not container.get("image"):
                raise invalid("Pod", obj["metadata"]["name"], f"spec.containers[{number}]: name and image are required")
            container.setdefault("imagePullPolicy", "IfNotPresent")
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("resources", {})
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    elif plural == "nodes":
        obj.setdefault("spec", {})
        obj.setdefault("status", {})


def _containers(spec: Obj) -> Iterable[Any]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])
