"""`kai-isolator certs`: ensure the webhook's serving Secret exists and is valid, then set caBundle. Idempotent."""

from __future__ import annotations

import argparse
import base64
import json
import os
from pathlib import Path

import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from kai_isolator.shared.errors import ConfigError, IsolatorError
from kai_isolator.shared.settings import load

from . import pki
from .settings import CertsSettings

MANAGED_BY = {"app.kubernetes.io/managed-by": "kai-isolator-certs", "app.kubernetes.io/part-of": "kai-resource-isolator"}


class CertsError(IsolatorError):
    """The API server refused or lacks something the one-shot needs."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    parser = commands.add_parser("certs", help="create or renew the webhook serving Secret and patch caBundle (one-shot)",
                                 description=__doc__)
    parser.add_argument("--namespace", help="namespace of the Service and Secret (env KAI_ISOLATOR_NAMESPACE; default this pod's)")
    parser.add_argument("--service", dest="service_name", help="webhook Service (env KAI_ISOLATOR_SERVICE_NAME, default kai-resource-isolator-webhook)")
    parser.add_argument("--secret", dest="secret_name", help="TLS Secret (env KAI_ISOLATOR_SECRET_NAME, default kai-resource-isolator-webhook-tls)")
    parser.add_argument("--webhook-config", help="MutatingWebhookConfiguration to patch; '' = none (default kai-resource-isolator-mutating)")
    parser.add_argument("--webhook-config-manifest", type=Path, help="create the configuration from this file if it is missing")
    parser.add_argument("--host", dest="hosts", action="append", help="extra DNS name or IP in the certificate (repeatable)")
    parser.add_argument("--validity-days", type=int, help="lifetime of a new pair (default 3650)")
    parser.add_argument("--renew-before-days", type=int, help="replace a pair expiring within this many days (default 30)")
    parser.add_argument("--out-dir", type=Path, help="write ca.crt, tls.crt, tls.key here instead of a Secret")
    parser.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: in-cluster service account)")
    return parser


async def run(args: argparse.Namespace) -> int:
    settings = load(CertsSettings, args)
    needs_api = settings.out_dir is None or bool(settings.webhook_config)
    api = await _api_client(settings) if needs_api else None
    try:
        bundle = await ensure_pair(settings, api)
        if api is not None and settings.webhook_config:
            await ensure_ca_bundle(api, settings, bundle.ca_crt)
    finally:
        if api is not None:
            await api.close()
    return 0


async def _api_client(settings: CertsSettings) -> client.ApiClient:
    if settings.kubeconfig is not None:
        try:
            return await config.new_client_from_config(config_file=str(settings.kubeconfig))
        except (OSError, config.ConfigException) as error:
            raise ConfigError(f"kubeconfig {settings.kubeconfig}: {error}") from None
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as error:
        raise ConfigError(f"not in a cluster and no --kubeconfig given: {error}") from None
    return client.ApiClient(configuration)


def _say(message: str) -> None:
    print(f"kai-isolator certs: {message}", flush=True)


def _fail(action: str, error: ApiException) -> CertsError:
    detail = error.reason
    try:
        detail = json.loads(error.body).get("message", detail)
    except (TypeError, ValueError, AttributeError):
        pass
    return CertsError(f"{action}: HTTP {error.status}: {detail}")


async def ensure_pair(settings: CertsSettings, api: client.ApiClient | None) -> pki.Bundle:
    """The pair to serve with: the stored one while it is good, else a new one, stored before it is returned."""
    namespace = settings.resolved_namespace()
    hosts = settings.all_hosts(namespace)
    if not hosts:
        raise ConfigError("no host names: give --namespace (or run in a pod) with --service, or --host")
    if settings.out_dir is not None:
        return _ensure_files(settings.out_dir, hosts, settings)
    if not namespace:
        raise ConfigError("no namespace: give --namespace or KAI_ISOLATOR_NAMESPACE")
    assert api is not None
    core = client.CoreV1Api(api)
    for _ in range(3):  # a concurrent run may create or replace the Secret between our read and write
        try:
            secret = await core.read_namespaced_secret(settings.secret_name, namespace)
        except ApiException as error:
            if error.status != 404:
                raise _fail(f"read Secret {namespace}/{settings.secret_name}", error) from None
            secret = None
        stored = _bundle_of(secret.data if secret else None)
        why = pki.still_serves(stored, hosts, settings.renew_before_days) if stored else "no stored pair"
        if why is None:
            _say(f"Secret {namespace}/{settings.secret_name} still serves {hosts[0]}; kept")
            return stored  # type: ignore[return-value]
        bundle = pki.issue(hosts, settings.validity_days)
        body = _secret_body(settings.secret_name, namespace, bundle)
        try:
            if secret is None:
                await core.create_namespaced_secret(namespace, body)
            else:
                body["metadata"]["resourceVersion"] = secret.metadata.resource_version
                await core.replace_namespaced_secret(settings.secret_name, namespace, body)
        except ApiException as error:
            if error.status == 409:
                continue
            raise _fail(f"write Secret {namespace}/{settings.secret_name}", error) from None
        _say(f"Secret {namespace}/{settings.secret_name} {'created' if secret is None else 'replaced'} ({why})")
        return bundle
    raise CertsError(f"Secret {namespace}/{settings.secret_name} kept changing under us; run again")


def _bundle_of(data: dict[str, str] | None) -> pki.Bundle | None:
    if not data or not all(k in data for k in ("ca.crt", "tls.crt", "tls.key")):
        return None
    try:
        return pki.Bundle(*(base64.b64decode(data[k], validate=True) for k in ("ca.crt", "tls.crt", "tls.key")))
    except ValueError:
        return None


def _secret_body(name: str, namespace: str, bundle: pki.Bundle) -> dict:
    encode = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)},
        "data": {"ca.crt": encode(bundle.ca_crt), "tls.crt": encode(bundle.tls_crt), "tls.key": encode(bundle.tls_key)},
    }


def _ensure_files(directory: Path, hosts: list[str], settings: CertsSettings) -> pki.Bundle:
    paths = [directory / n for n in ("ca.crt", "tls.crt", "tls.key")]
    if all(p.is_file() for p in paths):
        stored = pki.Bundle(*(p.read_bytes() for p in paths))
        why = pki.still_serves(stored, hosts, settings.renew_before_days)
        if why is None:
            _say(f"{directory} still serves {hosts[0]}; kept")
            return stored
    else:
        why = "no stored pair"
    bundle = pki.issue(hosts, settings.validity_days)
    directory.mkdir(parents=True, exist_ok=True)
    # Key first and each file atomically: a webhook reloading mid-write keeps its previous good pair.
    for path, data, mode in ((paths[2], bundle.tls_key, 0o600), (paths[1], bundle.tls_crt, 0o644), (paths[0], bundle.ca_crt, 0o644)):
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(partial, path)
    _say(f"wrote a new pair to {directory} ({why})")
    return bundle


async def ensure_ca_bundle(api: client.ApiClient, settings: CertsSettings, ca_pem: bytes) -> None:
    """Set caBundle on every webhook of the configuration (creating it from the manifest if asked and missing)."""
    admission = client.AdmissionregistrationV1Api(api)
    name = settings.webhook_config
    try:
        current = await admission.read_mutating_webhook_configuration(name)
    except ApiException as error:
        if error.status != 404 or settings.webhook_config_manifest is None:
            raise _fail(f"read MutatingWebhookConfiguration {name}", error) from None
        current = None
    ca = base64.b64encode(ca_pem).decode()
    if current is None:
        manifest = _load_manifest(settings.webhook_config_manifest, name)  # type: ignore[arg-type]
        for webhook in manifest.get("webhooks", []):
            webhook.setdefault("clientConfig", {})["caBundle"] = ca
        try:
            await admission.create_mutating_webhook_configuration(manifest)
        except ApiException as error:
            raise _fail(f"create MutatingWebhookConfiguration {name}", error) from None
        _say(f"created MutatingWebhookConfiguration {name} with caBundle")
        return
    webhooks = current.webhooks or []
    if not webhooks:
        raise CertsError(f"MutatingWebhookConfiguration {name} has no webhooks to give a caBundle")
    if all(w.client_config.ca_bundle == ca for w in webhooks):
        _say(f"MutatingWebhookConfiguration {name} already trusts this CA")
        return
    ops: list[dict[str, str]] = []
    for index, webhook in enumerate(webhooks):
        # `test` pins each index to its webhook: a concurrent edit fails the patch instead of misplacing a CA.
        ops.append({"op": "test", "path": f"/webhooks/{index}/name", "value": webhook.name})
        ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": ca})
    try:
        await admission.patch_mutating_webhook_configuration(name, ops)
    except ApiException as error:
        raise _fail(f"patch caBundle of MutatingWebhookConfiguration {name}", error) from None
    _say(f"MutatingWebhookConfiguration {name}: caBundle set on {len(webhooks)} webhook(s)")


def _load_manifest(path: Path, name: str) -> dict:
    try:
        manifest = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"--webhook-config-manifest {path}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "MutatingWebhookConfiguration":
        raise ConfigError(f"--webhook-config-manifest {path}: not a MutatingWebhookConfiguration")
    if manifest.get("metadata", {}).get("name") != name:
        raise ConfigError(f"--webhook-config-manifest {path}: names {manifest.get('metadata', {}).get('name')!r}, expected {name!r}")
    return manifest
