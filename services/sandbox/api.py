"""`SandboxApi`: the sandbox Kubernetes API server, in-process for tests and `kai-isolator dev`. A TEST AND DEMO FIXTURE.

Start it, point kubernetes-asyncio or kubectl at `write_kubeconfig()`, and drive it through
the same REST calls a cluster would get, or through the in-process methods here.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.settings import split_host_port

from .admission import WebhookCaller, validate_configuration
from .nodesim import NodeSimulator
from .patching import apply_patch
from .settings import SandboxSettings
from .status import ApiError
from .store import Obj, Store

log = logging.getLogger(__name__)


class SandboxApi:
    """Store + admission + node simulator + HTTP server."""

    def __init__(self, settings: SandboxSettings | None = None) -> None:
        self.settings = settings or SandboxSettings()
        self.store = Store(self.settings.retained_events)
        self.store.validators.setdefault("mutatingwebhookconfigurations", []).append(validate_configuration)
        self.nodes = NodeSimulator(self.store, self.settings.node_step_s)
        self.webhooks = WebhookCaller()
        self.url = ""
        self._runner: web.AppRunner | None = None

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        from .server import build_app  # the HTTP layer needs this class; import late to keep one direction

        try:
            host, port = split_host_port(self.settings.listen)
            for name, memory in self.settings.node_specs():
                self.nodes.add_node(name, memory)
        except ValueError as error:
            raise ConfigError(f"invalid sandbox setting: {error}") from None
        await self.nodes.start()
        self._runner = web.AppRunner(build_app(self), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as error:
            await self.stop()
            raise ConfigError(f"sandbox cannot listen on {self.settings.listen}: {error}") from None
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        if self.settings.kubeconfig:
            self.write_kubeconfig(self.settings.kubeconfig)
        log.info("sandbox API serving (test/demo fixture)", extra={"url": self.url})

    async def stop(self) -> None:
        self.store.close_watches()
        await self.nodes.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.webhooks.close()

    async def __aenter__(self) -> SandboxApi:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    def kubeconfig(self) -> Obj:
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "sandbox", "preferences": {},
            "clusters": [{"name": "sandbox", "cluster": {"server": self.url}}],
            "users": [{"name": "sandbox-admin", "user": {"token": "sandbox"}}],
            "contexts": [{"name": "sandbox", "context": {"cluster": "sandbox", "user": "sandbox-admin", "namespace": "default"}}],
        }

    def write_kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig for this server (JSON is valid YAML); atomically, so readers never see half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.kubeconfig(), indent=2) + "\n")
        partial.chmod(0o600)
        partial.replace(path)
        return path

    # --- the operations the REST layer and tests share ----------------------------------

    async def create(self, plural: str, body: Obj, namespace: str | None = None, *, dry_run: bool = False, warnings: list[str] | None = None) -> Obj:
        """Create an object; pods go through KAI's simulated admission, then every registered mutating webhook."""
        warnings = warnings if warnings is not None else []
        if plural != "pods":
            return self.store.create(plural, body, namespace, dry_run=dry_run)
        pod = self.store.prepare("pods", body, namespace)
        pod = self.nodes.kai_admit(pod)
        namespace_obj = self.store.get("namespaces", None, pod["metadata"]["namespace"])
        configurations, _ = self.store.list("mutatingwebhookconfigurations")
        pod = await self.webhooks.admit_pod(pod, namespace_obj, configurations, warnings)
        return self.store.create("pods", pod, pod["metadata"]["namespace"], dry_run=dry_run)

    def get(self, plural: str, namespace: str | None, name: str) -> Obj:
        return self.store.get(plural, namespace, name)

    def list(self, plural: str, namespace: str | None = None, label_selector: str | None = None, field_selector: str | None = None) -> tuple[list[Obj], int]:
        return self.store.list(plural, namespace, label_selector, field_selector)

    def patch(self, plural: str, namespace: str | None, name: str, content_type: str, patch: Any, *, subresource: str = "", dry_run: bool = False) -> Obj:
        current = self.store.get(plural, namespace, name)
        patched = apply_patch(current, content_type, patch)
        return self.replace(plural, namespace, name, patched, subresource=subresource, dry_run=dry_run)

    def replace(self, plural: str, namespace: str | None, name: str, body: Obj, *, subresource: str = "", dry_run: bool = False) -> Obj:
        current = self.store.get(plural, namespace, name)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        if subresource == "status":
            # The status subresource changes status only, whatever else the body says.
            body = {**current, "status": body.get("status", current.get("status")), "metadata": {**current["metadata"], "resourceVersion": (body.get("metadata") or {}).get("resourceVersion")}}
        elif "status" in current:
            body = {**body, "status": current["status"]}
        return self.store.update(plural, namespace, name, body, dry_run=dry_run)

    def delete(self, plural: str, namespace: str | None, name: str, *, dry_run: bool = False) -> Obj:
        return self.store.delete(plural, namespace, name, dry_run=dry_run)

    def bind(self, namespace: str, name: str, binding: Obj) -> Obj:
        target = (binding.get("target") or {}) if isinstance(binding, dict) else {}
        if not target.get("name"):
            raise ApiError(400, "a Binding needs target.name")
        self.store.get("nodes", None, target["name"])
        return self.nodes.bind(namespace, name, target["name"])

    def compact(self) -> None:
        """Forget the change history now, so any older resourceVersion answers 410 Gone."""
        self.store.compact()

    async def register_webhook(self, name: str, url: str, ca_bundle_pem: bytes | str, *, failure_policy: str = "Fail", timeout_s: int = 10,
                               namespace_selector: Obj | None = None, object_selector: Obj | None = None, match_conditions: list[Obj] | None = None) -> Obj:
        """Register one pod-CREATE mutating webhook at an HTTPS URL, trusted through `ca_bundle_pem`."""
        pem = ca_bundle_pem.encode() if isinstance(ca_bundle_pem, str) else ca_bundle_pem
        hook: Obj = {
            "name": f"{name}.sandbox.kai-isolator.io" if "." not in name else name,
            "clientConfig": {"url": url, "caBundle": base64.b64encode(pem).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "Namespaced"}],
            "failurePolicy": failure_policy, "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": timeout_s,
            "namespaceSelector": namespace_selector or {}, "objectSelector": object_selector or {},
        }
        if match_conditions:
            hook["matchConditions"] = match_conditions
        return self.store.create("mutatingwebhookconfigurations", {"metadata": {"name": name}, "webhooks": [hook]})
