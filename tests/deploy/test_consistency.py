"""Manifests, chart and compose say what the code means: real subcommands and flags (parsed by the real CLI),
real env names (from the settings classes), matching ports, paths, probe routes, Secret and Service names."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from pathlib import Path, PurePosixPath

import pytest
import yaml
from aiohttp import web
from deploy_tools import NATS_CLUSTER_VARIANTS, NO_NRI_VARIANTS, NRI_COMMAND, NRI_CONTAINER, REPO, Docs, containers, pod_specs
from prometheus_client import CollectorRegistry
from pydantic_settings import BaseSettings

from kai_isolator.services import registry
from kai_isolator.services.admission.server import AdmissionServer
from kai_isolator.services.admission.settings import AdmissionSettings
from kai_isolator.services.certs.settings import CertsSettings
from kai_isolator.services.cli import build_parser
from kai_isolator.services.devcluster.settings import DevClusterSettings
from kai_isolator.services.nodeagent.layout import HostLayout
from kai_isolator.services.nodeagent.settings import NodeAgentSettings
from kai_isolator.services.verifier.settings import VerifierSettings
from kai_isolator.services.watcher.settings import WatcherSettings
from kai_isolator.shared.probes import add_probe_routes
from kai_isolator.shared.settings import BusSettings, ProbeSettings, load, split_host_port

COMPOSE = REPO / "docker-compose.yml"
NODEAGENT_DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.nodeagent"
NRI_MAIN = REPO / "services" / "nodeagent" / "nri" / "main.go"
ALL_VARIANTS = ["kustomize/base", "kustomize/cert-manager", "kustomize/dev", "helm/default", "helm/optional", "helm/minimal",
               "kustomize/nats-cluster", "helm/nats-cluster", *NO_NRI_VARIANTS]


def settings_classes() -> list[type[BaseSettings]]:
    """Every settings class of the shared package and of each service that has one."""
    modules = [importlib.import_module("kai_isolator.shared.settings")]
    for service in registry.SERVICES:
        with contextlib.suppress(ModuleNotFoundError):
            modules.append(importlib.import_module(f"kai_isolator.services.{service}.settings"))
    return [obj for m in modules for obj in vars(m).values()
            if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj.__module__ == m.__name__]


def env_fields() -> dict[str, tuple[type[BaseSettings], str]]:
    """KAI_ISOLATOR_* name -> (settings class, field), as pydantic-settings reads them."""
    found = {}
    for cls in settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        for field in cls.model_fields:
            found[(prefix + field).upper()] = (cls, field)
    return found


ENV_FIELDS = env_fields()


def parse(argv: list[str]) -> argparse.Namespace:
    """The real CLI's parse, with argparse's complaint as the failure message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`kai-isolator {' '.join(argv)}` does not parse: {err.getvalue().strip()}")


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def config_maps(docs: Docs) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def container_env(container: dict, docs: Docs) -> dict[str, str]:
    """Literal env the container gets (ConfigMap envFrom, then env values); valueFrom fields map to a marker."""
    env: dict[str, str] = {}
    maps = config_maps(docs)
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            assert name in maps, f"envFrom names ConfigMap {name}, which is not rendered"
            env.update(maps[name])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "<valueFrom>")
    return env


def effective(cls: type[BaseSettings], args: argparse.Namespace, env: dict[str, str]) -> BaseSettings:
    """The settings the service would load: env from the manifest, flags win, like `load()` in the service."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in __import__("os").environ if n.startswith("KAI_ISOLATOR_")]:
            mp.delenv(name)
        for name, value in env.items():
            if value != "<valueFrom>":
                mp.setenv(name, value)
        return load(cls, args)


def ours(container: dict) -> bool:
    """Our images: the released repository (helm), the kustomize base's and the dev images' names."""
    return any(name in container["image"] for name in ("projecthami/kai-resource-isolator", "kai-isolator"))


def is_test_hook(doc: dict) -> bool:
    """`helm test`'s pod: a check run in our image, not a service (no subcommand, no flags)."""
    return "test" in doc["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(",")


def is_nri_plugin(container: dict) -> bool:
    """The node agent's NRI plugin: our image, but the Go adapter (kai-isolator-nri), not a `kai-isolator` subcommand;
    checked on its own (test_the_nri_plugin_...)."""
    return container["name"] == NRI_CONTAINER and container.get("command") == NRI_COMMAND


def our_containers(docs: Docs) -> list[tuple[dict, dict, dict]]:
    return [(doc, spec, c) for doc, spec in pod_specs(docs) if not is_test_hook(doc) for c in containers(spec)
            if ours(c) and not is_nri_plugin(c)]


def port_of(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"{container['name']} has no port named {name}: {ports}"
    return ports[name]


def routes(app: web.Application) -> set[str]:
    return {r.canonical for r in app.router.resources()}


def probe_routes() -> set[str]:
    """What shared/probes.py serves on every bus service's probe port."""
    app = web.Application()
    add_probe_routes(app, CollectorRegistry(), lambda: [])
    return routes(app)


PROBE_ROUTES = probe_routes()


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_container_runs_a_real_subcommand_with_real_flags(rendered: dict[str, Docs], variant: str) -> None:
    known = subcommands()
    seen = set()
    for doc, _, container in our_containers(rendered[variant]):
        assert "command" not in container, f"{doc['metadata']['name']}: override args, keep the image's entrypoint"
        args = container["args"]
        assert args[0] in known, f"{doc['metadata']['name']} runs `kai-isolator {args[0]}`, not a subcommand ({sorted(known)})"
        parse(args)
        seen.add(args[0])
    expected = {"admission", "nodeagent"}
    expected |= {"certs"} if variant in ("kustomize/base", "kustomize/dev", "helm/default", "helm/minimal", *NATS_CLUSTER_VARIANTS) else set()
    expected |= set() if variant == "helm/minimal" else {"watcher", "verifier"}
    assert expected <= seen, f"{variant} lacks {expected - seen}"


# Read by the NVIDIA container runtime, not by us: it mounts NVML into the node agent (no GPU requested).
NVIDIA_RUNTIME_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_env_name_is_a_settings_field_and_its_value_loads(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    for doc, _, container in our_containers(docs):
        env = container_env(container, docs)
        if doc["metadata"]["name"].endswith("-nodeagent"):
            assert {k: env.pop(k, None) for k in NVIDIA_RUNTIME_ENV} == NVIDIA_RUNTIME_ENV, "the enforcer needs NVML"
        for name, value in env.items():
            assert name in ENV_FIELDS, f"{doc['metadata']['name']}: env {name} is read by no settings class"
            if value != "<valueFrom>":
                cls, field = ENV_FIELDS[name]
                effective(cls, argparse.Namespace(), {name: value})  # raises ConfigError on a bad value
    for data in config_maps(docs).values():
        unknown = [k for k in data if k.startswith("KAI_ISOLATOR_") and k not in ENV_FIELDS]
        assert not unknown, f"ConfigMap keys no settings class reads: {unknown}"


def _one(docs: Docs, kind: str, suffix: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} *{suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def _container(docs: Docs, kind: str, suffix: str) -> tuple[dict, dict]:
    doc = _one(docs, kind, suffix)
    spec = doc["spec"]["template"]["spec"]
    return spec, next(c for c in spec["containers"] if ours(c))


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_webhook_port_tls_paths_and_probes_match_the_server(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    spec, container = _container(docs, "Deployment", "-webhook")
    args = parse(container["args"])
    settings = effective(AdmissionSettings, args, container_env(container, docs))
    assert split_host_port(settings.listen)[1] == port_of(container, "https")
    served = routes(AdmissionServer(settings).build_app())
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"], get["scheme"]) == (path, "https", "HTTPS") and path in served
    service = _one(docs, "Service", "-webhook")
    assert service["spec"]["selector"].items() <= _one(docs, "Deployment", "-webhook")["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "https"
    mwc = _one(docs, "MutatingWebhookConfiguration", "-mutating")
    (hook,) = mwc["webhooks"]
    target = hook["clientConfig"]["service"]
    assert (target["name"], target["namespace"], target["port"]) == (service["metadata"]["name"], service["metadata"]["namespace"], port["port"])
    assert target["path"] in served
    # The TLS pair comes from the Secret mounted where the flags point.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for file in (settings.tls_cert_file, settings.tls_private_key_file):
        volume = volumes[mounts[str(PurePosixPath(file).parent)]]
        assert volume["secret"]["secretName"].endswith("-webhook-tls")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_bus_services_probe_where_they_listen(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    checked = 0
    for doc, _, container in our_containers(docs):
        if container["args"][0] not in ("watcher", "verifier", "nodeagent"):
            continue
        probe = effective(ProbeSettings, parse(container["args"]), container_env(container, docs))
        assert split_host_port(probe.probe_listen)[1] == port_of(container, "probes"), doc["metadata"]["name"]
        for kind, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = container[kind]["httpGet"]
            assert (get["path"], get["port"], get.get("scheme", "HTTP")) == (path, "probes", "HTTP") and path in PROBE_ROUTES
        checked += 1
    assert checked >= (1 if variant == "helm/minimal" else 3)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_library_and_state_paths_agree_between_webhook_agent_and_image(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    _, webhook = _container(docs, "Deployment", "-webhook")
    admission = effective(AdmissionSettings, parse(webhook["args"]), container_env(webhook, docs))
    spec, agent_container = _container(docs, "DaemonSet", "-nodeagent")
    agent = effective(NodeAgentSettings, parse(agent_container["args"]), container_env(agent_container, docs))
    assert agent.container_vgpu_mount == admission.container_vgpu_mount
    assert agent.grant_dir == admission.grant_dir, "the agent writes grants where the webhook does not mount them from"
    # Host paths as the agent sees them (under --host-root) must be the hostPath volumes mounted there. The one exception,
    # with NRI, is the host's cgroup hierarchy: at the host's own path, as the driver's cap names a leaf (checked in
    # test_the_nri_plugin_asks_the_agent_where_it_answers_and_the_webhook_requires_it_by_name).
    host_paths = {}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in agent_container["volumeMounts"]:
        if "hostPath" in volumes[mount["name"]]:
            inside = PurePosixPath(mount["mountPath"])
            if agent.nri_socket is not None and inside == PurePosixPath("/sys/fs/cgroup"):
                assert volumes[mount["name"]]["hostPath"]["path"] == str(inside)
                continue
            host_paths[str(PurePosixPath("/") / inside.relative_to(agent.host_root))] = volumes[mount["name"]]["hostPath"]["path"]
    assert all(k == v for k, v in host_paths.items()), f"agent sees host paths at other places: {host_paths}"
    layout = HostLayout.__new__(HostLayout)  # path arithmetic only: the host root does not exist here
    object.__setattr__(layout, "host_root", Path("/"))
    object.__setattr__(layout, "mount", agent.container_vgpu_mount)
    assert str(layout.install_dir) in host_paths, "the library directory is not a hostPath of the agent"
    assert str(layout.containers_dir) == admission.state_dir, "the webhook's state dir is not where the agent keeps container state"
    assert any(admission.state_dir.startswith(p + "/") for p in host_paths), "the state dir is not a hostPath of the agent"
    assert host_paths.get(admission.grant_dir) == admission.grant_dir, "the grant dir is not a hostPath of the agent"
    # The library the agent installs is the one the node agent image carries.
    copied = re.findall(r"^COPY --from=libvgpu \S+ (\S+)$", NODEAGENT_DOCKERFILE.read_text(), re.M)
    assert [str(p) for p in agent.library] == copied


@pytest.mark.parametrize("variant", ["kustomize/base", "kustomize/dev", "helm/default"])
def test_certs_job_targets_the_webhook_secret_service_and_configuration(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    _, container = _container(docs, "Job", "-certs")
    certs = effective(CertsSettings, parse(container["args"]), container_env(container, docs))
    service = _one(docs, "Service", "-webhook")
    spec, _ = _container(docs, "Deployment", "-webhook")
    tls_secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert certs.namespace == service["metadata"]["namespace"] and certs.service_name == service["metadata"]["name"]
    assert certs.secret_name in tls_secrets
    assert certs.webhook_config == _one(docs, "MutatingWebhookConfiguration", "-mutating")["metadata"]["name"]
    role = _one(docs, "Role", "-certs")
    assert any(certs.secret_name in r.get("resourceNames", []) for r in role["rules"])
    cluster_role = _one(docs, "ClusterRole", "-certs")
    assert cluster_role["rules"][0]["resourceNames"] == [certs.webhook_config]


@pytest.mark.parametrize("variant", ["kustomize/base", "kustomize/dev", "helm/default", "helm/optional", *NATS_CLUSTER_VARIANTS])
def test_nats_url_names_the_in_cluster_service(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    _, container = _container(docs, "Deployment", "-watcher")
    bus = effective(BusSettings, parse(container["args"]), container_env(container, docs))
    (url,) = bus.urls()
    match = re.fullmatch(r"nats://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", url)
    assert match, url
    name, namespace, port = match.groups()
    assert namespace == _one(docs, "Service", "-webhook")["metadata"]["namespace"]
    nats = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name]
    if variant in ("kustomize/dev", "helm/optional", *NATS_CLUSTER_VARIANTS):  # the variants that bring their own NATS
        assert [p["port"] for p in nats[0]["spec"]["ports"] if p["name"] == "client"] == [int(port)]
    else:
        assert not nats and (name, port) == ("nats", "4222"), "production expects the official NATS chart as release `nats`"


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with every variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_compose_runs_real_commands_with_real_env() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    for name, service in services.items():
        assert "healthcheck" in service or service.get("restart") == "no", f"compose service {name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            wanted = "service_completed_successfully" if services[dependency].get("restart") == "no" else "service_healthy"
            assert condition["condition"] == wanted, f"{name} -> {dependency}"
        if "kai-isolator" not in service["image"]:
            continue
        argv = [_interpolate(a) for a in service["command"]]
        args = parse(argv)
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        for key, value in env.items():
            if key.startswith("FAKE_CUDA_"):
                continue  # read by the GPU stand-in (hami-core/fake), not by us
            assert key in ENV_FIELDS, f"compose {name}: env {key} is read by no settings class"
            effective(ENV_FIELDS[key][0], argparse.Namespace(), {key: value})
        if argv[0] in ("watcher", "verifier", "nodeagent"):
            port = split_host_port(effective(ProbeSettings, args, env).probe_listen)[1]
            assert f"127.0.0.1:{port}/readyz" in " ".join(service["healthcheck"]["test"]), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in compose.get("volumes", {}) or (REPO / source).exists(), f"{name} mounts missing {source}"
    webhook = effective(AdmissionSettings, parse(services["webhook"]["command"]), {})
    certs = effective(CertsSettings, parse(services["certs"]["command"]), {})
    assert certs.out_dir == webhook.tls_cert_file.parent == webhook.tls_private_key_file.parent
    assert f":{split_host_port(webhook.listen)[1]}/readyz" in " ".join(services["webhook"]["healthcheck"]["test"])
    manifest = yaml.safe_load((REPO / "deploy/docker/compose/webhook-config.yaml").read_text())
    assert manifest["metadata"]["name"] == certs.webhook_config
    url = manifest["webhooks"][0]["clientConfig"]["url"]
    assert url == f"https://webhook:{split_host_port(webhook.listen)[1]}/mutate" and "webhook" in certs.hosts
    # The devcluster writes the admin kubeconfig into the `kube` volume, naming itself as the services reach it.
    devcluster = effective(DevClusterSettings, parse(services["devcluster"]["command"]), {})
    assert devcluster.server_name == "devcluster" and devcluster.kubeconfig is not None
    written_in = {v.split(":")[0]: v.split(":")[1] for v in services["devcluster"]["volumes"]}["kube"]
    assert devcluster.kubeconfig.parent == Path(written_in)
    for name in ("certs", "watcher", "verifier", "nodeagent"):
        mounted = {v.split(":")[0]: v.split(":")[1] for v in services[name]["volumes"]}["kube"]
        read = effective(KUBECONFIG_READERS[name], parse(services[name]["command"]), {}).kubeconfig
        assert read == Path(mounted) / devcluster.kubeconfig.name, name
        assert "devcluster" in services[name]["depends_on"], name
    agent = effective(NodeAgentSettings, parse(services["nodeagent"]["command"]), {})
    assert agent.node_name in devcluster.node_specs()


KUBECONFIG_READERS: dict[str, type[BaseSettings]] = {"certs": CertsSettings, "watcher": WatcherSettings, "verifier": VerifierSettings,
                                                    "nodeagent": NodeAgentSettings}


def _deployment_replicas(docs: Docs) -> dict[str, int]:
    return {d["metadata"]["name"].rsplit("-", 1)[-1]: d["spec"]["replicas"] for d in docs
            if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(("-watcher", "-verifier"))}


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_service_gets_the_stream_replicas_its_nats_can_hold(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    replicas = {doc["metadata"]["name"]: effective(BusSettings, parse(c["args"]), container_env(c, docs)).nats_replicas
                for doc, _, c in our_containers(docs) if c["args"][0] != "certs"}  # the one that never talks to NATS
    nats = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"]
    wanted = 3 if variant in NATS_CLUSTER_VARIANTS else 1
    assert set(replicas.values()) == {wanted}, replicas  # every service alike: each converges the stream to its own count
    if nats:
        assert wanted <= nats[0]["spec"]["replicas"]
    expected = {} if variant == "helm/minimal" else {"watcher": 2, "verifier": 2} if wanted > 1 else {"watcher": 1, "verifier": 1}
    assert _deployment_replicas(docs) == expected  # a standby watcher and a second verifier where the bus is replicated


@pytest.mark.parametrize(("values", "replicas", "deployments"), [
    ({"bus.url": "nats://nats.shared.svc:4222", "bus.replicas": "3"}, 3, {"watcher": 2, "verifier": 2}),  # an existing cluster
    ({"nats.cluster.enabled": "true", "watcher.replicaCount": "3", "verifier.replicaCount": "1"}, 3, {"watcher": 3, "verifier": 1}),
    ({"nats.cluster.enabled": "true", "nats.cluster.replicas": "5", "bus.replicas": "5"}, 5, {"watcher": 2, "verifier": 2}),
    ({"watcher.replicaCount": "2"}, 1, {"watcher": 2, "verifier": 1}),
], ids=lambda v: str(v))
def test_replica_values_reach_the_services(render_helm, values: dict[str, str], replicas: int, deployments: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    docs = render_helm(values)
    assert {effective(BusSettings, parse(c["args"]), container_env(c, docs)).nats_replicas
            for _, _, c in our_containers(docs) if c["args"][0] != "certs"} == {replicas}
    assert _deployment_replicas(docs) == deployments


def test_lease_terms_reach_the_watcher_and_the_installer(render_helm) -> None:  # type: ignore[no-untyped-def]
    from kai_isolator.services.watcher.settings import WatcherSettings

    docs = render_helm({"watcher.leaseTtlSeconds": "4", "installer.rollout.version": "0123456789abcdef", "installer.rollout.leaseTtlSeconds": "20"})
    _, watcher = _container(docs, "Deployment", "-watcher")
    assert effective(WatcherSettings, parse(watcher["args"]), container_env(watcher, docs)).lease_ttl_s == 4
    _, installer = _container(docs, "Job", "-rollout-0123456789abcdef")
    assert parse(installer["args"]).lease_ttl_s == 20


def nri_flags() -> set[str]:
    """The flags kai-isolator-nri defines (Go's flag package: `flag.String("name", ...)`)."""
    return set(re.findall(r'flag\.\w+\("([a-z-]+)"', NRI_MAIN.read_text()))


def _mount_at(container: dict, path: str) -> dict:
    found = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(found) == 1, f"{container['name']} mounts nothing (or twice) at {path}: {container.get('volumeMounts')}"
    return found[0]


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_the_nri_plugin_asks_the_agent_where_it_answers_and_the_webhook_requires_it_by_name(rendered: dict[str, Docs], variant: str) -> None:
    """The plugin's flags are its program's; it asks the agent at the agent's decision socket (one emptyDir both mount),
    reaches containerd's NRI socket through a hostPath of its directory, and registers under the name the webhook's
    required-plugins annotation names. Without NRI, none of it: the agent serves no socket, the webhook requires nothing."""
    docs = rendered[variant]
    spec, agent_container = _container(docs, "DaemonSet", "-nodeagent")
    agent = effective(NodeAgentSettings, parse(agent_container["args"]), container_env(agent_container, docs))
    _, webhook = _container(docs, "Deployment", "-webhook")
    admission = effective(AdmissionSettings, parse(webhook["args"]), container_env(webhook, docs))
    plugins = [c for c in containers(spec) if c["name"] == NRI_CONTAINER]
    volumes = {v["name"]: v for v in spec["volumes"]}
    if variant in NO_NRI_VARIANTS:
        assert not plugins and agent.nri_socket is None and admission.require_nri_plugin == ""
        assert "/sys/fs/cgroup" not in {m["mountPath"] for m in agent_container["volumeMounts"]}
        return
    [plugin] = plugins
    assert is_nri_plugin(plugin) and plugin["image"] == agent_container["image"], "the plugin is carried by the agent's image"
    flags = dict(a[2:].split("=", 1) for a in plugin["args"])
    assert len(flags) == len(plugin["args"]) and set(flags) <= nri_flags(), f"{plugin['args']} vs the flags of {NRI_MAIN.name}"
    assert flags["name"] == admission.require_nri_plugin, "the webhook requires a plugin by another name than the one registered"
    assert re.fullmatch(r"[0-9]{2}", flags["idx"]), flags["idx"]
    assert re.fullmatch(r"[1-9][0-9]*s", flags.get("reconnect", "")), "without --reconnect a node without NRI never has the pod Ready"
    # The decision socket: where the agent serves it, in an emptyDir both containers mount at the same place.
    assert agent.nri_socket is not None and flags["agent-socket"] == str(agent.nri_socket)
    where = str(PurePosixPath(flags["agent-socket"]).parent)
    shared = {_mount_at(agent_container, where)["name"], _mount_at(plugin, where)["name"]}
    assert len(shared) == 1 and "emptyDir" in volumes[shared.pop()], "the two containers share the socket through one emptyDir"
    # containerd's NRI socket: its host directory, mounted where the flag looks.
    nri_dir = str(PurePosixPath(flags["nri-socket"]).parent)
    assert volumes[_mount_at(plugin, nri_dir)["name"]]["hostPath"]["path"] == nri_dir
    # The host's cgroups at the host's path, read-only: what creation.v2_mount finds and the driver is handed.
    cgroup = _mount_at(agent_container, "/sys/fs/cgroup")
    assert cgroup.get("readOnly") is True and volumes[cgroup["name"]]["hostPath"]["path"] == "/sys/fs/cgroup"
    # The program is on the image's PATH.
    dockerfile = NODEAGENT_DOCKERFILE.read_text()
    [installed] = re.findall(r"^COPY --from=nri \S+ (\S+)$", dockerfile, re.M)
    assert PurePosixPath(installed).name == NRI_COMMAND[0]
    assert str(PurePosixPath(installed).parent) in re.search(r"^ENV PATH=(\S+)", dockerfile, re.M).group(1).split(":")  # type: ignore[union-attr]
