"""Mutating admission for the sandbox API: calls registered webhooks over HTTPS like kube-apiserver (test/demo fixture).

Honours `clientConfig.url` + `caBundle`, `rules`, `namespaceSelector`, `objectSelector`,
`matchConditions` (see conditions.py), `failurePolicy` and `timeoutSeconds`; applies the
returned JSON patch or rejects with the webhook's message.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import ssl
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from .conditions import Condition, ConditionError
from .patching import apply_json_patch
from .selectors import label_selector_object_matches
from .status import ApiError, invalid

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MWC_KIND = "MutatingWebhookConfiguration"
MWC_GROUP = "admissionregistration.k8s.io"


def validate_configuration(config: Obj) -> None:
    """Refuse a MutatingWebhookConfiguration the sandbox could not honour, with a 422 like the real validation."""
    name = config["metadata"]["name"]
    webhooks = config.get("webhooks") or []
    if not isinstance(webhooks, list):
        raise invalid(MWC_KIND, name, "webhooks: must be a list", MWC_GROUP)
    for i, hook in enumerate(webhooks):
        where = f"webhooks[{i}]"
        if not isinstance(hook, dict) or not hook.get("name"):
            raise invalid(MWC_KIND, name, f"{where}.name: Required value", MWC_GROUP)
        client = hook.get("clientConfig") or {}
        url = client.get("url")
        if client.get("service"):
            raise invalid(MWC_KIND, name, f"{where}.clientConfig.service: Unsupported value: the sandbox calls webhooks by clientConfig.url only", MWC_GROUP)
        if not url or urlsplit(url).scheme != "https":
            raise invalid(MWC_KIND, name, f"{where}.clientConfig.url: Invalid value: {url!r}: 'https' scheme required", MWC_GROUP)
        if client.get("caBundle"):
            try:
                _ssl_context(client["caBundle"])
            except (ValueError, ssl.SSLError, binascii.Error) as error:
                raise invalid(MWC_KIND, name, f"{where}.clientConfig.caBundle: Invalid value: {error}", MWC_GROUP) from None
        if hook.get("sideEffects") not in ("None", "NoneOnDryRun"):
            raise invalid(MWC_KIND, name, f"{where}.sideEffects: Unsupported value: {hook.get('sideEffects')!r}: supported values: \"None\", \"NoneOnDryRun\"", MWC_GROUP)
        if "v1" not in (hook.get("admissionReviewVersions") or []):
            raise invalid(MWC_KIND, name, f"{where}.admissionReviewVersions: Invalid value: must include v1", MWC_GROUP)
        timeout = hook.setdefault("timeoutSeconds", 10)
        if not isinstance(timeout, int) or not 1 <= timeout <= 30:
            raise invalid(MWC_KIND, name, f"{where}.timeoutSeconds: Invalid value: {timeout!r}: the timeout value must be between 1 and 30 seconds", MWC_GROUP)
        if hook.setdefault("failurePolicy", "Fail") not in ("Fail", "Ignore"):
            raise invalid(MWC_KIND, name, f"{where}.failurePolicy: Unsupported value: {hook['failurePolicy']!r}", MWC_GROUP)
        hook.setdefault("namespaceSelector", {})
        hook.setdefault("objectSelector", {})
        hook.setdefault("matchPolicy", "Equivalent")
        hook.setdefault("reinvocationPolicy", "Never")
        for j, condition in enumerate(hook.get("matchConditions") or []):
            try:
                Condition(str(condition.get("expression", "")))
            except ConditionError as error:
                raise invalid(MWC_KIND, name, f"{where}.matchConditions[{j}].expression: Invalid value: compilation failed: {error}", MWC_GROUP) from None


_CONTEXTS: dict[str, ssl.SSLContext] = {}


def _ssl_context(ca_bundle: str) -> ssl.SSLContext:
    if ca_bundle not in _CONTEXTS:
        pem = base64.b64decode(ca_bundle, validate=True).decode()
        _CONTEXTS[ca_bundle] = ssl.create_default_context(cadata=pem)
    return _CONTEXTS[ca_bundle]


def _rule_matches(rule: Obj, operation: str) -> bool:
    def has(key: str, value: str) -> bool:
        values = rule.get(key) or []
        return "*" in values or value in values

    scope_ok = rule.get("scope", "*") in ("*", "Namespaced")
    return has("operations", operation) and has("apiGroups", "") and has("apiVersions", "v1") and has("resources", "pods") and scope_ok


class WebhookCaller:
    """Runs every registered mutating webhook that applies to a pod CREATE, in name order."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def admit_pod(self, pod: Obj, namespace: Obj, configurations: list[Obj], warnings: list[str]) -> Obj:
        for config in sorted(configurations, key=lambda c: c["metadata"]["name"]):
            for hook in config.get("webhooks") or []:
                pod = await self._run_hook(hook, pod, namespace, warnings)
        return pod

    async def _run_hook(self, hook: Obj, pod: Obj, namespace: Obj, warnings: list[str]) -> Obj:
        name = hook["name"]
        ignore = hook.get("failurePolicy", "Fail") == "Ignore"
        if not any(_rule_matches(rule, "CREATE") for rule in hook.get("rules") or []):
            return pod
        if not label_selector_object_matches(hook.get("namespaceSelector"), namespace["metadata"].get("labels")):
            return pod
        if not label_selector_object_matches(hook.get("objectSelector"), pod["metadata"].get("labels")):
            return pod
        try:
            if not all(Condition(c["expression"]).evaluate(pod) for c in hook.get("matchConditions") or []):
                return pod
        except ConditionError as error:
            if ignore:
                return pod
            raise ApiError(500, f'Internal error occurred: failed calling webhook "{name}": match condition error: {error}') from None
        try:
            response = await self._call(hook, pod)
        except _CallFailed as failure:
            if ignore:
                log.warning("webhook failed; failurePolicy Ignore admits the pod unchanged", extra={"webhook": name, "error": str(failure)})
                return pod
            raise ApiError(500, f'Internal error occurred: failed calling webhook "{name}": {failure}') from None
        warnings.extend(str(w) for w in response.get("warnings") or [])
        if not response.get("allowed"):
            status = response.get("status") or {}
            code = int(status.get("code") or 400)
            message = status.get("message") or "without explanation"
            raise ApiError(max(code, 400), f'admission webhook "{name}" denied the request: {message}', reason=status.get("reason") or None)
        return self._apply(name, ignore, pod, response)

    @staticmethod
    def _apply(name: str, ignore: bool, pod: Obj, response: Obj) -> Obj:
        if not response.get("patch"):
            return pod
        try:
            if response.get("patchType") != "JSONPatch":
                raise ValueError(f"unsupported patchType {response.get('patchType')!r}")
            operations = json.loads(base64.b64decode(response["patch"], validate=True))
            patched = apply_json_patch(pod, operations)
        except (ValueError, binascii.Error, ApiError) as error:
            if ignore:
                return pod
            raise ApiError(500, f'Internal error occurred: failed calling webhook "{name}": invalid patch: {error}') from None
        patched["metadata"]["namespace"] = pod["metadata"].get("namespace")
        return patched

    async def _call(self, hook: Obj, pod: Obj) -> Obj:
        client = hook["clientConfig"]
        timeout_s = int(hook.get("timeoutSeconds", 10))
        url = f"{client['url']}{'&' if '?' in client['url'] else '?'}timeout={timeout_s}s"
        context = _ssl_context(client["caBundle"]) if client.get("caBundle") else ssl.create_default_context()
        request_uid = str(uuid.uuid4())
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": _request(request_uid, pod)}
        try:
            async with self._client().post(url, json=review, ssl=context, timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                if reply.status != 200:
                    raise _CallFailed(f"expected response code 200, got {reply.status}: {(await reply.text())[:200]}")
                body = await reply.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ssl.SSLError, ValueError) as error:
            if isinstance(error, _CallFailed):
                raise
            detail = "context deadline exceeded" if isinstance(error, asyncio.TimeoutError) else f"{type(error).__name__}: {error}"
            raise _CallFailed(f'failed to call webhook: Post "{url}": {detail}') from None
        response = body.get("response") if isinstance(body, dict) else None
        if not isinstance(response, dict):
            raise _CallFailed("received invalid webhook response: no 'response' in the AdmissionReview")
        if response.get("uid") != request_uid:
            raise _CallFailed(f"expected response.uid={request_uid!r}, got {response.get('uid')!r}")
        return response


class _CallFailed(ValueError):
    pass


def _request(request_uid: str, pod: Obj) -> Obj:
    meta = pod["metadata"]
    gvk = {"group": "", "version": "v1", "kind": "Pod"}
    gvr = {"group": "", "version": "v1", "resource": "pods"}
    return {
        "uid": request_uid, "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": meta.get("name", ""), "namespace": meta.get("namespace", ""), "operation": "CREATE",
        "userInfo": {"username": "sandbox-admin", "groups": ["system:masters", "system:authenticated"]},
        "object": pod, "oldObject": None, "dryRun": False,
        "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
    }
