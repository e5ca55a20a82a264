"""`kai-isolator certs` against a small fake API server: Secret create/keep/renew, caBundle patch, clear failures."""

from __future__ import annotations

import base64
import copy
import datetime
import json
from pathlib import Path

import jsonpatch
import pytest
from aiohttp import web
from cryptography import x509

from kai_isolator.services.certs import pki
from kai_isolator.services.certs.command import CertsError
from kai_isolator.services.cli import build_parser
from kai_isolator.shared.errors import ConfigError

MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
NS = "kai-resource-isolator"
HOSTS = [f"kai-resource-isolator-webhook.{NS}.svc", f"kai-resource-isolator-webhook.{NS}.svc.cluster.local"]


class FakeApi:
    """Just the Secrets and MutatingWebhookConfigurations the one-shot touches, with resourceVersion conflicts."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict] = {}
        self.mwcs: dict[str, dict] = {}
        self.version = 1
        self.writes: list[str] = []
        app = web.Application()
        app.router.add_route("*", "/api/v1/namespaces/{ns}/secrets", self.secret_collection)
        app.router.add_route("*", "/api/v1/namespaces/{ns}/secrets/{name}", self.secret_item)
        app.router.add_route("*", MWC_PATH, self.mwc_collection)
        app.router.add_route("*", MWC_PATH + "/{name}", self.mwc_item)
        self.app = app

    def _bump(self, obj: dict) -> dict:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        return obj

    @staticmethod
    def _status(code: int, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}, status=code)

    async def secret_collection(self, request: web.Request) -> web.Response:
        body = await request.json()
        key = (request.match_info["ns"], body["metadata"]["name"])
        if key in self.secrets:
            return self._status(409, "already exists")
        self.secrets[key] = self._bump(body)
        self.writes.append("secret:create")
        return web.json_response(body, status=201)

    async def secret_item(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        if request.method == "GET":
            if key not in self.secrets:
                return self._status(404, f'secrets "{key[1]}" not found')
            return web.json_response(self.secrets[key])
        body = await request.json()
        if body["metadata"].get("resourceVersion") != self.secrets[key]["metadata"]["resourceVersion"]:
            return self._status(409, "the object has been modified")
        self.secrets[key] = self._bump(body)
        self.writes.append("secret:replace")
        return web.json_response(body)

    async def mwc_collection(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.mwcs[body["metadata"]["name"]] = self._bump(body)
        self.writes.append("mwc:create")
        return web.json_response(body, status=201)

    async def mwc_item(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.mwcs:
            return self._status(404, f'mutatingwebhookconfigurations.admissionregistration.k8s.io "{name}" not found')
        if request.method == "GET":
            return web.json_response(self.mwcs[name])
        assert request.content_type == "application/json-patch+json", request.content_type
        try:
            patched = jsonpatch.apply_patch(copy.deepcopy(self.mwcs[name]), await request.json())
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
            return self._status(422, str(error))
        self.mwcs[name] = self._bump(patched)
        self.writes.append("mwc:patch")
        return web.json_response(patched)


def webhook_config(name: str = "kai-resource-isolator-mutating", hooks: int = 1) -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [{
            "name": f"hook{i}.kai-resource-isolator.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "clientConfig": {"service": {"name": "kai-resource-isolator-webhook", "namespace": NS, "path": "/mutate"}},
        } for i in range(hooks)],
    }


@pytest.fixture
async def fake(aiohttp_server_factory) -> FakeApi:
    api = FakeApi()
    await aiohttp_server_factory(api.app)
    return api


@pytest.fixture
async def aiohttp_server_factory(tmp_path: Path):
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        (tmp_path / "kubeconfig").write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "fake", "user": {"token": "unused"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def certs(tmp_path: Path, *extra: str) -> int:
    args = build_parser().parse_args(["certs", "--kubeconfig", str(tmp_path / "kubeconfig"), "--namespace", NS, *extra])
    return await args.run(args)


def stored_secret(fake: FakeApi) -> pki.Bundle:
    data = fake.secrets[(NS, "kai-resource-isolator-webhook-tls")]["data"]
    return pki.Bundle(*(base64.b64decode(data[k]) for k in ("ca.crt", "tls.crt", "tls.key")))


async def test_first_run_creates_a_valid_secret_and_sets_ca_bundle(fake: FakeApi, tmp_path: Path) -> None:
    fake.mwcs["kai-resource-isolator-mutating"] = webhook_config(hooks=2)
    assert await certs(tmp_path) == 0
    bundle = stored_secret(fake)
    assert fake.secrets[(NS, "kai-resource-isolator-webhook-tls")]["type"] == "kubernetes.io/tls"
    assert pki.still_serves(bundle, HOSTS, renew_before_days=30) is None
    leaf = x509.load_pem_x509_certificate(bundle.tls_crt)
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert set(HOSTS) <= set(names)
    hooks = fake.mwcs["kai-resource-isolator-mutating"]["webhooks"]
    assert [base64.b64decode(h["clientConfig"]["caBundle"]) for h in hooks] == [bundle.ca_crt, bundle.ca_crt]


async def test_second_run_keeps_a_good_pair_and_writes_nothing(fake: FakeApi, tmp_path: Path) -> None:
    fake.mwcs["kai-resource-isolator-mutating"] = webhook_config()
    assert await certs(tmp_path) == 0
    before, writes = stored_secret(fake), list(fake.writes)
    assert await certs(tmp_path) == 0
    assert stored_secret(fake) == before
    assert fake.writes == writes


async def test_expiring_or_garbage_pair_is_replaced_and_ca_bundle_follows(fake: FakeApi, tmp_path: Path) -> None:
    fake.mwcs["kai-resource-isolator-mutating"] = webhook_config()
    old = pki.issue(HOSTS, validity_days=10)
    encode = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    fake.secrets[(NS, "kai-resource-isolator-webhook-tls")] = fake._bump({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kai-resource-isolator-webhook-tls", "namespace": NS},
        "data": {"ca.crt": encode(old.ca_crt), "tls.crt": encode(old.tls_crt), "tls.key": encode(old.tls_key)}})
    assert await certs(tmp_path) == 0
    renewed = stored_secret(fake)
    assert renewed.tls_crt != old.tls_crt and "secret:replace" in fake.writes
    ca = fake.mwcs["kai-resource-isolator-mutating"]["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(ca) == renewed.ca_crt

    fake.secrets[(NS, "kai-resource-isolator-webhook-tls")]["data"]["tls.crt"] = encode(b"not a certificate")
    assert await certs(tmp_path) == 0
    assert pki.still_serves(stored_secret(fake), HOSTS, 30) is None


async def test_missing_webhook_configuration_is_a_clear_error_after_the_secret_is_stored(fake: FakeApi, tmp_path: Path) -> None:
    with pytest.raises(CertsError, match=r"read MutatingWebhookConfiguration kai-resource-isolator-mutating: HTTP 404: .*not found"):
        await certs(tmp_path)
    assert pki.still_serves(stored_secret(fake), HOSTS, 30) is None


async def test_out_dir_mode_writes_files_and_creates_the_configuration_from_a_manifest(fake: FakeApi, tmp_path: Path) -> None:
    manifest = tmp_path / "mwc.json"
    manifest.write_text(json.dumps(webhook_config()))
    out = tmp_path / "tls"
    assert await certs(tmp_path, "--out-dir", str(out), "--service", "", "--host", "webhook", "--host", "127.0.0.1",
                       "--webhook-config-manifest", str(manifest)) == 0
    bundle = pki.Bundle(*((out / n).read_bytes() for n in ("ca.crt", "tls.crt", "tls.key")))
    assert pki.still_serves(bundle, ["webhook", "127.0.0.1"], 30) is None
    assert (out / "tls.key").stat().st_mode & 0o077 == 0
    assert not fake.secrets
    created = fake.mwcs["kai-resource-isolator-mutating"]["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(created) == bundle.ca_crt


async def test_bad_settings_fail_before_touching_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="renew_before_days"):
        await certs(tmp_path, "--validity-days", "10", "--renew-before-days", "10")
    with pytest.raises(ConfigError, match="kubeconfig"):
        await certs(tmp_path)  # no kubeconfig file was written


def test_still_serves_names_what_is_wrong() -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    pair = pki.issue(["a.example"], validity_days=100, now=now)
    assert pki.still_serves(pair, ["a.example"], 30, now=now) is None
    assert "does not cover b.example" in pki.still_serves(pair, ["a.example", "b.example"], 30, now=now)
    assert "expires" in pki.still_serves(pair, ["a.example"], 30, now=now + datetime.timedelta(days=80))
    other = pki.issue(["a.example"], validity_days=100, now=now)
    assert "not issued by the stored CA" in pki.still_serves(pki.Bundle(other.ca_crt, pair.tls_crt, pair.tls_key), ["a.example"], 30)
    assert "does not belong" in pki.still_serves(pki.Bundle(pair.ca_crt, pair.tls_crt, other.tls_key), ["a.example"], 30)
