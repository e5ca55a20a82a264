"""The bundled three-node NATS cluster (Helm nats.cluster.enabled, kustomize overlays/nats-cluster): routes that
name every member, a quorum kept through drains and node loss, a config the real nats-server accepts."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from deploy_tools import NATS_CLUSTER_VARIANTS, Docs, ToolError

from kai_isolator.shared.embedded_nats import server_binary


def _one(docs: Docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _nats_objects(docs: Docs) -> dict[tuple[str, str], dict]:
    """The NATS objects as they run: spec (or data), without the labels and the config checksum only Helm adds."""
    out = {}
    for doc in docs:
        if doc["metadata"].get("labels", {}).get("app.kubernetes.io/name") != "nats":
            continue
        body = yaml.safe_load(yaml.safe_dump(doc.get("spec") or doc.get("data")))
        if doc["kind"] == "StatefulSet":
            body["template"]["metadata"].pop("annotations", None)
        out[(doc["kind"], doc["metadata"]["name"])] = body
    return out


@pytest.mark.parametrize("variant", NATS_CLUSTER_VARIANTS)
def test_three_servers_route_to_each_other_by_stable_names(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    sts = _one(docs, "StatefulSet", "nats")
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    headless = _one(docs, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = spec["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    [container] = spec["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    [route_port] = [p for p in headless["spec"]["ports"] if p["name"] == "cluster"]
    assert ports[route_port["targetPort"]] == route_port["port"] == 6222
    conf = _one(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    ns = sts["metadata"]["namespace"]
    routes = [line.strip() for line in conf.splitlines() if line.strip().startswith("nats://")]
    assert routes == [f"nats://nats-{i}.{spec['serviceName']}.{ns}.svc:6222" for i in range(3)]
    # The config file is where the server is told to read it, and names each server after its pod.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    config_volume = next(n for n, v in volumes.items() if v.get("configMap", {}).get("name") == "nats-config")
    assert container["args"] == [f"--config={mounts[config_volume]}/nats.conf"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert "server_name: $POD_NAME" in conf
    # The pid file lame duck mode is signalled through is on a writable volume (the root is read-only).
    pid_dir = next(line.split(":", 1)[1].strip() for line in conf.splitlines() if line.startswith("pid_file:")).rsplit("/", 1)[0]
    assert "emptyDir" in volumes[next(n for n, p in mounts.items() if p == pid_dir)]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["nats-server", f"--signal=ldm={pid_dir}/nats.pid"]


@pytest.mark.parametrize("variant", NATS_CLUSTER_VARIANTS)
def test_quorum_survives_a_drain_and_a_lost_node(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    sts = _one(docs, "StatefulSet", "nats")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    pdb = _one(docs, "PodDisruptionBudget", "nats")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    [term] = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"].items() <= pod_labels.items()


def test_soft_anti_affinity_only_prefers_spreading(render_helm: Callable[..., Docs]) -> None:
    docs = render_helm({"nats.cluster.enabled": "true", "nats.cluster.antiAffinity": "soft"})
    anti = _one(docs, "StatefulSet", "nats")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert list(anti) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_five_servers_route_to_all_five(render_helm: Callable[..., Docs]) -> None:
    docs = render_helm({"nats.cluster.enabled": "true", "nats.cluster.replicas": "5"})
    assert _one(docs, "StatefulSet", "nats")["spec"]["replicas"] == 5
    assert _one(docs, "ConfigMap", "nats-config")["data"]["nats.conf"].count("nats://nats-") == 5


@pytest.mark.parametrize("variant", NATS_CLUSTER_VARIANTS)
def test_the_real_nats_server_accepts_the_config(rendered: dict[str, Docs], variant: str, tmp_path: Path) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text(_one(rendered[variant], "ConfigMap", "nats-config")["data"]["nats.conf"])
    done = subprocess.run([str(server_binary()), "-t", "-c", str(conf)], env={"POD_NAME": "nats-1"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "is valid" in done.stderr + done.stdout


def test_chart_and_overlay_run_the_same_cluster(rendered: dict[str, Docs]) -> None:
    chart, overlay = _nats_objects(rendered["helm/nats-cluster"]), _nats_objects(rendered["kustomize/nats-cluster"])
    assert set(chart) == {("Service", "nats"), ("Service", "nats-cluster"), ("ConfigMap", "nats-config"),
                          ("PodDisruptionBudget", "nats"), ("StatefulSet", "nats")}
    assert chart == overlay


@pytest.mark.parametrize(("values", "message"), [
    ({"nats.cluster.enabled": "true", "nats.cluster.replicas": "2"}, "nats.cluster.replicas must be odd and at least 3"),
    ({"nats.cluster.enabled": "true", "nats.cluster.replicas": "1"}, "nats.cluster.replicas must be odd and at least 3"),
    ({"nats.cluster.enabled": "true", "nats.cluster.antiAffinity": "maybe"}, "nats.cluster.antiAffinity must be hard or soft"),
    ({"nats.cluster.enabled": "true", "bus.replicas": "5"}, "bus.replicas 5 exceeds the bundled cluster's 3 servers"),
    ({"nats.enabled": "true", "bus.replicas": "3"}, "bus.replicas 3 needs a NATS cluster"),
    ({"bus.replicas": "0"}, "bus.replicas must be 1 to 5"),
    ({"bus.replicas": "7"}, "bus.replicas must be 1 to 5"),
])
def test_bad_cluster_values_fail_with_a_clear_message(render_helm: Callable[..., Docs], values: dict[str, str], message: str) -> None:
    with pytest.raises(ToolError, match=message):
        render_helm(values)
