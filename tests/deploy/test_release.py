"""The chart as a release publishes it: its values schema refuses what it does not know, its images live in the release's
repository and a digest pins them, its `helm test` hook is a GPU-sharing pod that checks the library, and it travels
through a real OCI registry (CNCF Distribution) under the name users install it by."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from deploy_tools import CHART, Docs, ToolError, pod_specs

from kai_isolator.services.devcluster.oci import image_archive
from kai_isolator.services.devcluster.oci_registry import OciRegistry, pick_loopback_address
from kai_isolator.services.devcluster.oci_push import push_archive
from kai_isolator.services.devcluster.release import REPOSITORY, Helm, ReleaseError, pin_digests, registry_client

VERSION = "1.0.0"
SERVICES_DIGEST = "sha256:" + "1" * 64
NODEAGENT_DIGEST = "sha256:" + "2" * 64


def images(docs: Docs) -> dict[str, str]:
    """Each container's image, by `<object name>/<container name>`."""
    return {f"{doc['metadata']['name']}/{c['name']}": c["image"] for doc, spec in pod_specs(docs) for c in spec["containers"]}


def test_the_chart_is_the_release_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)


@pytest.mark.parametrize(("key", "value", "where"), [
    ("webhook.replicaCont", "3", "/webhook': additional properties 'replicaCont'"),  # a typo of a real value
    ("nodeAgent.image.digst", NODEAGENT_DIGEST, "/nodeAgent/image': additional properties 'digst'"),  # nested
    ("imag.tag", "dev", "': additional properties 'imag'"),  # at the top
    ("tests.gpuMemroy", "512", "/tests': additional properties 'gpuMemroy'"),
    ("nodeAgent.nri.enable", "false", "/nodeAgent/nri': additional properties 'enable'"),  # the off switch, misspelt
])
def test_a_misspelt_value_is_refused(render_helm: Callable[..., Docs], key: str, value: str, where: str) -> None:
    with pytest.raises(ToolError, match=rf"(?s)values don't meet the specifications of the schema.*{re.escape(where)} not allowed"):
        render_helm({key: value})


@pytest.mark.parametrize(("key", "value"), [
    ("webhook.replicaCount", "two"),
    ("nodeAgent.image.digest", "sha256:abc"),  # not a digest
    ("logs.level", "verbose"),
])
def test_a_value_of_the_wrong_kind_is_refused(render_helm: Callable[..., Docs], key: str, value: str) -> None:
    with pytest.raises(ToolError, match="values don't meet the specifications of the schema"):
        render_helm({key: value})


def test_every_value_of_values_yaml_is_in_the_schema() -> None:
    """The schema refuses unknown keys, so a value added to values.yaml without it would refuse the chart's own defaults;
    helm lint catches that too, this says which key."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def missing(values: dict, node: dict, path: str) -> list[str]:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node
        found = []
        for key, value in values.items():
            known = node.get("properties", {})
            if key not in known and node.get("additionalProperties") is False:
                found.append(f"{path}{key}")
            elif key in known and isinstance(value, dict):
                found += missing(value, known[key], f"{path}{key}.")
        return found

    assert missing(yaml.safe_load((CHART / "values.yaml").read_text()), schema, "") == []


def test_the_defaults_name_the_release_repository_by_tag(rendered: dict[str, Docs]) -> None:
    named = images(rendered["helm/default"])
    assert named["kai-resource-isolator-webhook/webhook"] == f"{REPOSITORY}:{VERSION}"
    assert named["kai-resource-isolator-nodeagent/nodeagent"] == f"{REPOSITORY}:{VERSION}-nodeagent"
    ours = {image for image in named.values() if "projecthami" in image}
    assert ours == {f"{REPOSITORY}:{VERSION}", f"{REPOSITORY}:{VERSION}-nodeagent"}


def test_a_digest_pins_each_image(render_helm: Callable[..., Docs]) -> None:
    named = images(render_helm({"image.digest": SERVICES_DIGEST, "nodeAgent.image.digest": NODEAGENT_DIGEST}))
    ours = {image for image in named.values() if "projecthami" in image}
    assert ours == {f"{REPOSITORY}:{VERSION}@{SERVICES_DIGEST}", f"{REPOSITORY}:{VERSION}-nodeagent@{NODEAGENT_DIGEST}"}


def _test_pod(docs: Docs) -> dict:
    [pod] = [d for d in docs if "test" in d["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(",")]
    return pod


def test_helm_test_is_a_gpu_sharing_pod_that_checks_the_library(rendered: dict[str, Docs]) -> None:
    pod = _test_pod(rendered["helm/default"])
    assert pod["kind"] == "Pod" and pod["metadata"]["namespace"] == "default"  # where the webhook acts (not the release's)
    assert pod["metadata"]["annotations"]["gpu-memory"] == "1024"
    spec = pod["spec"]
    assert spec["schedulerName"] == "kai-scheduler" and spec["restartPolicy"] == "Never"
    [container] = spec["containers"]
    assert container["image"] == images(rendered["helm/default"])["kai-resource-isolator-nodeagent/nodeagent"]
    assert container["command"] == ["python3", "-I", "-c"]
    [script] = container["args"]
    compile(script, "helm-test", "exec")
    assert '"/usr/local/vgpu/libvgpu.so"' in script and "/etc/ld.so.preload" in script and "/proc/self/maps" in script


def test_the_test_pod_follows_the_library_mount(render_helm: Callable[..., Docs]) -> None:
    [script] = _test_pod(render_helm({"paths.containerVgpuMount": "/opt/vgpu/"}))["spec"]["containers"][0]["args"]
    assert '"/opt/vgpu/libvgpu.so"' in script


def test_a_release_pins_digests_and_keeps_every_comment_of_the_values() -> None:
    original = (CHART / "values.yaml").read_text()
    pinned = pin_digests(original, {"image": SERVICES_DIGEST, "nodeAgent.image": NODEAGENT_DIGEST})
    expected = yaml.safe_load(original)
    expected["image"]["digest"], expected["nodeAgent"]["image"]["digest"] = SERVICES_DIGEST, NODEAGENT_DIGEST
    assert yaml.safe_load(pinned) == expected  # the two digests, nothing else (nats.image.digest stays empty)
    comments = [line for line in original.splitlines() if line.lstrip().startswith("#")]
    assert comments and [line for line in pinned.splitlines() if line.lstrip().startswith("#")] == comments
    with pytest.raises(ReleaseError, match="no nodeAgent.imag"):
        pin_digests(original, {"nodeAgent.imag": NODEAGENT_DIGEST})


@pytest.fixture
def local_registry(release_tools_built: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[OciRegistry, Helm]]:
    """A registry of its own on a loopback address, and helm resolving docker.io (and ghcr.io, nvcr.io) to it."""
    helm_binary, registry_binary = release_tools_built
    with OciRegistry(registry_binary, tmp_path / "registry", address=pick_loopback_address()) as registry:
        yield registry, Helm(helm_binary, tmp_path / "helm", registry)


def test_the_chart_travels_through_the_registry_under_the_name_users_install_by(local_registry: tuple[OciRegistry, Helm],
                                                                                tmp_path: Path) -> None:
    registry, helm = local_registry
    helm("package", str(CHART), "--version", f"{VERSION}-chart", "--destination", str(tmp_path))
    pushed = helm("push", str(tmp_path / f"kai-resource-isolator-{VERSION}-chart.tgz"), "oci://docker.io/projecthami", *helm.registry_flags)
    assert f"Pushed: docker.io/projecthami/kai-resource-isolator:{VERSION}-chart" in pushed, pushed
    # What users type, but for --ca-file: the name resolves to the local registry, whose CA helm is told to trust.
    shown = yaml.safe_load(helm("show", "chart", "oci://docker.io/projecthami/kai-resource-isolator", "--version", f"{VERSION}-chart",
                                *helm.registry_flags))
    assert (shown["name"], shown["version"], shown["appVersion"]) == ("kai-resource-isolator", f"{VERSION}-chart", VERSION)
    # Not trusted by default: TLS is verified, the registry is not reached as an insecure one.
    untrusted = helm.run("show", "chart", "oci://docker.io/projecthami/kai-resource-isolator", "--version", f"{VERSION}-chart")
    assert untrusted.returncode != 0 and "certificate signed by unknown authority" in untrusted.stderr, untrusted
    # Stored where the images go: the repository users name, the chart as an OCI artifact.
    media_type, manifest = registry_client(registry).manifest("projecthami/kai-resource-isolator", f"{VERSION}-chart")
    assert json.loads(manifest)["config"]["mediaType"] == "application/vnd.cncf.helm.config.v1+json", (media_type, manifest)


def test_an_image_is_pushed_compressed_and_pushed_again_unchanged(local_registry: tuple[OciRegistry, Helm], tmp_path: Path) -> None:
    registry, _ = local_registry
    archive = image_archive("docker.io/library/probe:1", {"/bin/sh": Path("/bin/dash")}, tmp_path / "probe.tar", command=["/bin/sh"])
    client = registry_client(registry)
    first = push_archive(client, archive, "docker.io/library/probe:1", tmp_path / "layers")
    again = push_archive(client, archive, "docker.io/library/probe:1", tmp_path / "layers")
    assert first == again and re.fullmatch(r"sha256:[0-9a-f]{64}", first.digest)
    assert first.layers == 1 and first.pull_bytes < first.unpacked_bytes  # gzip, as `docker push` sends layers
    _, manifest = client.manifest("library/probe", first.digest)
    assert [layer["mediaType"] for layer in json.loads(manifest)["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]
