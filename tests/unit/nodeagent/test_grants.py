"""The grant the node agent writes: computed from KAI's ConfigMap and the annotation (the smaller wins, never
raised once written), on the GPUs KAI's reservation pods hold for the pod's GPU groups, refused on missing or bad
inputs, and written atomically, root-owned and 0444."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from kai_isolator.services.nodeagent.grant_decision import Inputs, decide, env_ref, never_raised, parse_devices, target_container
from kai_isolator.services.nodeagent.grant_files import collect_stale, grant_path, read_grant, remove_grants, write_grant
from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.grant import Grant, GrantSource

MIB = 1 << 20
UUID0 = "GPU-0000fa4e-1111-2222-3333-000000000000"
UUID1 = "GPU-0100fa4e-1111-2222-3333-000000000001"
UID = "7f3c2a10-1111-4222-8333-444455556666"
GROUPS = ("6a1f0c2e-0000-4000-8000-00000000000a", "6a1f0c2e-0000-4000-8000-00000000000b")
# What KAI's reservation pods on the node hold: GPU 0 for the first group, GPU 1 for the second.
RESERVED = {GROUPS[0]: frozenset({UUID0}), GROUPS[1]: frozenset({UUID1})}


def group_labels(devices: int) -> dict[str, str]:
    """KAI's binder's labels for a pod given the node's first `devices` GPU groups."""
    if devices == 1:
        return {"runai-gpu-group": GROUPS[0]}
    return {f"runai-gpu-group/{g}": g for g in GROUPS[:devices]}


def pod(annotations: dict[str, str] | None = None, containers: list[str] | None = None, inits: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": "gpu-node-1", "containers": [{"name": n, "image": "x"} for n in containers or ["main"]]}
    if inits:
        spec["initContainers"] = [{"name": n, "image": "x"} for n in inits]
    asked = (annotations or {}).get("gpu-fraction-num-devices", "1")
    labels = group_labels(int(asked)) if asked in ("1", "2") else {}
    return {"metadata": {"name": "train", "namespace": "team-a", "uid": UID, "labels": labels,
                         "annotations": {"gpu-memory": "4096", **(annotations or {})}}, "spec": spec}


def computed(limit: str | None = "4147m", devices: str | None = UUID0, label: str | None = "15360", **annotations: str) -> Any:
    p = pod(annotations)
    return decide(p, p["spec"]["containers"][0], Inputs(limit, devices, label, reserved=RESERVED))


def test_the_seed_example_grants_the_configmap_limit_on_the_listed_device() -> None:
    decision = computed()
    grant = decision.grant
    assert grant is not None and decision.reasons == ()
    assert (grant.pod_uid, grant.namespace, grant.pod, grant.container) == (UID, "team-a", "train", "main")
    assert [(d.uuid, d.limit_bytes) for d in grant.devices] == [(UUID0, 4147 * MIB)]
    assert grant.source is GrantSource.CONFIGMAP and grant.configmap_limit_bytes == grant.annotation_limit_bytes == 4147 * MIB


def test_a_configmap_raised_by_the_tenant_loses_to_the_annotation_and_says_why() -> None:
    decision = computed(limit="15g")
    grant = decision.grant
    assert grant is not None and grant.source is GrantSource.ANNOTATION and grant.devices[0].limit_bytes == 4147 * MIB
    assert [r.code for r in decision.reasons] == ["limit-disagrees"]
    assert "15g" not in grant.reason and str(15 << 30) in grant.reason and "gpu-memory annotation '4096'" in grant.reason


def test_a_smaller_configmap_limit_is_granted_as_is() -> None:
    decision = computed(limit="2048m")
    assert decision.grant is not None and decision.grant.source is GrantSource.CONFIGMAP
    assert decision.grant.devices[0].limit_bytes == 2048 * MIB and [r.code for r in decision.reasons] == ["limit-disagrees"]


def test_fraction_pods_cross_check_on_the_raw_label() -> None:
    p = pod()
    p["metadata"]["annotations"] = {"gpu-fraction": "0.5"}
    decision = decide(p, p["spec"]["containers"][0], Inputs("40779m", UUID0, "81559", reserved=RESERVED))
    assert decision.grant is not None and decision.grant.devices[0].limit_bytes == 40779 * MIB and not decision.reasons


def test_every_listed_device_gets_the_limit_cdi_form_included() -> None:
    decision = computed(devices=f" k8s.device-plugin.nvidia.com/gpu={UUID0}, {UUID1} ", **{"gpu-fraction-num-devices": "2"})
    assert decision.grant is not None and [d.uuid for d in decision.grant.devices] == [UUID0, UUID1]
    assert {d.limit_bytes for d in decision.grant.devices} == {4147 * MIB}


@pytest.mark.parametrize(("devices", "asked"), [(f"{UUID0},{UUID1}", None), (f"{UUID0},{UUID1}", "1"), (UUID0, "2"), (UUID0, "two"), (UUID0, "0")])
def test_a_configmap_naming_other_than_the_devices_asked_for_gets_no_grant(devices: str, asked: str | None) -> None:
    # The tenant edits its ConfigMap to name both GPUs of the node: the limit would hold on each.
    decision = computed(devices=devices, **({"gpu-fraction-num-devices": asked} if asked else {}))
    assert decision.grant is None and [r.code for r in decision.reasons] == ["devices-invalid"], decision
    assert "gpu-fraction-num-devices" in decision.reasons[0].message


def test_a_configmap_naming_a_gpu_kai_reserved_for_another_group_gets_no_grant() -> None:
    # The tenant edits its ConfigMap to name the node's other GPU, one device as asked: KAI booked the share on GPU 0.
    decision = computed(devices=UUID1)
    assert decision.grant is None and not decision.retry and [r.code for r in decision.reasons] == ["devices-not-reserved"], decision
    assert UUID1 in decision.reasons[0].message and UUID0 in decision.reasons[0].message


@pytest.mark.parametrize("case", ["no group label", "no reservation seen", "two GPUs for one group"])
def test_a_gpu_not_known_to_be_reserved_is_waited_for(case: str) -> None:
    p = pod()
    reserved = dict(RESERVED)
    if case == "no group label":
        p["metadata"]["labels"] = {}
    elif case == "no reservation seen":
        del reserved[GROUPS[0]]
    else:
        reserved[GROUPS[0]] = frozenset({UUID0, UUID1})
    decision = decide(p, p["spec"]["containers"][0], Inputs("4147m", UUID0, "15360", reserved=reserved))
    assert decision.grant is None and decision.retry and [r.code for r in decision.reasons] == ["devices-unreserved"], decision


def test_without_what_the_reservation_pods_hold_nothing_is_granted() -> None:
    p = pod()
    decision = decide(p, p["spec"]["containers"][0], Inputs("4147m", UUID0, "15360"))
    assert decision.grant is None and [r.code for r in decision.reasons] == ["devices-unreserved"]


@pytest.mark.parametrize(("inputs", "code"), [
    ({"limit": None}, "limit-missing"),
    ({"limit": "lots"}, "limit-invalid"),
    ({"limit": "0"}, "limit-invalid"),
    ({"devices": None}, "devices-missing"),
    ({"devices": "0"}, "devices-invalid"),
    ({"devices": ","}, "devices-invalid"),
    ({"devices": f"{UUID0},{UUID0}"}, "devices-invalid"),
    ({"label": None}, "node-label-invalid"),
    ({"label": "lots"}, "node-label-invalid"),
    ({"label": "50"}, "annotation-invalid"),
])
def test_missing_or_bad_inputs_grant_nothing_and_name_the_reason(inputs: dict[str, Any], code: str) -> None:
    decision = computed(**inputs)
    assert decision.grant is None and not decision.retry
    assert code in [r.code for r in decision.reasons] and all(r.message for r in decision.reasons)


def test_a_bad_annotation_grants_nothing() -> None:
    decision = computed(**{"gpu-memory": "-1"})
    assert decision.grant is None and [r.code for r in decision.reasons] == ["annotation-invalid"]


def test_a_configmap_not_written_yet_is_retried() -> None:
    p = pod()
    decision = decide(p, p["spec"]["containers"][0], Inputs(None, None, "15360", missing_configmaps=("train-abc-shared-gpu-0",), reserved=RESERVED))
    assert decision.grant is None and decision.retry and [r.code for r in decision.reasons] == ["configmap-missing"]
    assert "train-abc-shared-gpu-0" in decision.reasons[0].message


def test_a_written_grant_is_never_raised_but_may_shrink() -> None:
    first = computed().grant
    assert first is not None
    higher = computed(limit="8000m", **{"gpu-memory": "8000"}).grant
    assert higher is not None and higher.devices[0].limit_bytes > first.devices[0].limit_bytes
    kept, reason = never_raised(higher, first)
    assert kept is first and reason is not None and reason.code == "grant-kept"
    lower = computed(limit="1024m").grant
    assert never_raised(lower, first) == (lower, None)  # type: ignore[arg-type]
    p = pod()  # the pod's GPU group on another GPU later (a reservation pod made again)
    moved = decide(p, p["spec"]["containers"][0], Inputs("4147m", UUID1, "15360", reserved={GROUPS[0]: frozenset({UUID1})})).grant
    assert moved is not None and never_raised(moved, first)[0] is first


def test_target_is_the_named_container_init_containers_first() -> None:
    assert target_container(pod())["name"] == "main"  # type: ignore[index]
    assert target_container(pod({"gpu-fraction-container-name": "gpu"}, ["main", "gpu"]))["name"] == "gpu"  # type: ignore[index]
    named = pod({"gpu-fraction-container-name": "same"}, ["same"], inits=["same"])
    assert target_container(named) is named["spec"]["initContainers"][0]
    assert target_container(pod({"gpu-fraction-container-name": "absent"})) is None


def test_env_refs_literal_configmap_and_last_definition_wins() -> None:
    container = {"env": [
        {"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "1g"},
        {"name": "CUDA_DEVICE_MEMORY_LIMIT", "valueFrom": {"configMapKeyRef": {"name": "cm-0", "key": "CUDA_DEVICE_MEMORY_LIMIT"}}},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": UUID0},
    ]}
    ref = env_ref(container, "CUDA_DEVICE_MEMORY_LIMIT")
    assert ref is not None and (ref.configmap, ref.key, ref.literal) == ("cm-0", "CUDA_DEVICE_MEMORY_LIMIT", None)
    assert env_ref(container, "NVIDIA_VISIBLE_DEVICES").literal == UUID0  # type: ignore[union-attr]
    assert env_ref(container, "OTHER") is None


def test_device_lists_parse_as_kai_writes_them() -> None:
    assert parse_devices(f"{UUID0},k8s.device-plugin.nvidia.com/gpu={UUID1}") == (UUID0, UUID1)
    assert parse_devices("MIG-5a2b4c3d-1111-2222-3333-444455556666") == ("MIG-5a2b4c3d-1111-2222-3333-444455556666",)
    for bad in ("all", "", "GPU-x y", "../etc"):
        with pytest.raises(ConfigError):
            parse_devices(bad)


# --- the file --------------------------------------------------------------------------


def a_grant(limit_mib: int = 4147, uid: str = UID, container: str = "main") -> Grant:
    return Grant.model_validate({**computed(limit=f"{limit_mib}m").grant.model_dump(), "pod_uid": uid, "container": container})  # type: ignore[union-attr]


def test_written_grant_is_root_owned_read_only_and_reads_back(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    grant = a_grant()
    assert write_grant(root, grant) is True
    path = grant_path(root, UID, "main")
    assert path == root / f"{UID}_main" / "grant.json"
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o444 and info.st_uid == os.geteuid()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    assert read_grant(root, UID, "main") == grant
    assert Grant.model_validate_json(path.read_text()) == grant  # the exact shape libvgpu.so parses
    assert os.listdir(path.parent) == ["grant.json"]  # no temp file left behind


def test_rewriting_the_same_grant_touches_nothing_and_a_new_one_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    write_grant(root, a_grant())
    inode = grant_path(root, UID, "main").stat().st_ino
    assert write_grant(root, a_grant()) is False  # written_at differs, the grant does not
    assert grant_path(root, UID, "main").stat().st_ino == inode
    assert write_grant(root, a_grant(1024)) is True
    assert read_grant(root, UID, "main").devices[0].limit_bytes == 1024 * MIB  # type: ignore[union-attr]
    assert grant_path(root, UID, "main").stat().st_ino != inode  # replaced by rename, never rewritten in place


def test_a_directory_the_kubelet_made_first_is_used_and_a_damaged_file_is_rewritten(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    (root / f"{UID}_main").mkdir(parents=True, mode=0o700)
    (root / f"{UID}_main" / "grant.json").write_text("{not json")
    assert read_grant(root, UID, "main") is None
    assert write_grant(root, a_grant()) is True
    assert read_grant(root, UID, "main") == a_grant().model_copy(update={"written_at": read_grant(root, UID, "main").written_at})  # type: ignore[union-attr]
    assert stat.S_IMODE((root / f"{UID}_main").stat().st_mode) == 0o755


def test_links_planted_in_the_grant_tree_are_never_written_through(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / f"{UID}_main")
    with pytest.raises(OSError):
        write_grant(root, a_grant())
    assert list(elsewhere.iterdir()) == []
    os.unlink(root / f"{UID}_main")
    (root / f"{UID}_main").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, root / f"{UID}_main" / "grant.json")
    assert write_grant(root, a_grant()) is True
    assert victim.read_text() == "keep" and not (root / f"{UID}_main" / "grant.json").is_symlink()


@pytest.mark.parametrize(("uid", "container"), [("../x", "main"), (UID, "a/b"), (UID, ".."), ("", "main")])
def test_names_that_cannot_be_one_path_component_are_refused(tmp_path: Path, uid: str, container: str) -> None:
    with pytest.raises(ConfigError):
        grant_path(tmp_path, uid, container)


def test_readers_never_see_a_partial_grant(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    write_grant(root, a_grant(4000))
    path = grant_path(root, UID, "main")
    seen: set[int] = set()
    failures: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                seen.add(Grant.model_validate_json(path.read_bytes()).devices[0].limit_bytes >> 20)
            except Exception as error:  # noqa: BLE001 - any failure is the finding
                failures.append(repr(error))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for limit in range(4000, 3800, -1):
            write_grant(root, a_grant(limit))
    finally:
        done.set()
        reader.join()
    assert failures == [] and len(seen) > 1 and seen <= set(range(3801, 4001))


def test_removing_a_pod_removes_every_container_grant_it_has(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    other = "11111111-2222-4333-8444-555555555555"
    for uid, container in ((UID, "main"), (UID, "helper"), (other, "main")):
        write_grant(root, a_grant(uid=uid, container=container))
    assert sorted(remove_grants(root, UID)) == ["helper", "main"]
    assert sorted(os.listdir(root)) == [f"{other}_main"]
    assert remove_grants(root, UID) == [] and remove_grants(tmp_path / "absent", UID) == []


def test_stale_grants_go_only_after_the_grace(tmp_path: Path) -> None:
    root = tmp_path / "grants"
    gone = "11111111-2222-4333-8444-555555555555"
    write_grant(root, a_grant())
    write_grant(root, a_grant(uid=gone))
    assert collect_stale(root, {UID}, grace_s=3600) == []
    assert collect_stale(root, {UID}, grace_s=0) == [f"{gone}_main"]
    assert sorted(os.listdir(root)) == [f"{UID}_main"]


# --- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["grants", "/", "/var/lib/../grants", "/var/lib/grants/", "//grants"])
def test_the_grant_dir_setting_must_be_a_clean_absolute_path(bad: str) -> None:
    from pydantic import ValidationError

    from kai_isolator.services.nodeagent.settings import NodeAgentSettings

    with pytest.raises(ValidationError, match="--grant-dir"):
        NodeAgentSettings(grant_dir=bad)
    assert NodeAgentSettings().grant_dir == "/var/lib/kai-isolator/grants"


async def test_without_an_api_no_client_and_a_broken_config_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kai_isolator.services.nodeagent.grants import api_client

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert await api_client(None) is None
    with pytest.raises(ConfigError, match="cannot load a Kubernetes client configuration"):
        await api_client(tmp_path / "no-such-kubeconfig")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="cannot load a Kubernetes client configuration"):
        await api_client(None)  # in a pod without a service account token


def test_a_gpu_annotation_kai_never_admitted_is_named_as_such() -> None:
    """Under the default scheduler KAI neither names ConfigMaps nor adds env: the reason says so, not 'KAI wrote no limit'."""
    p = pod()
    decision = decide(p, p["spec"]["containers"][0], Inputs(None, None, "15360", reserved=RESERVED))
    assert decision.grant is None and not decision.retry and [r.code for r in decision.reasons] == ["not-admitted-by-kai"]
    assert "schedulerName 'default-scheduler'" in decision.reasons[0].message and "set schedulerName: kai-scheduler" in decision.reasons[0].message


def test_no_limit_env_at_all_points_at_kais_hamicore_plugin() -> None:
    p = pod({"runai/shared-gpu-configmap": "train-abc-shared-gpu"})
    decision = decide(p, p["spec"]["containers"][0], Inputs(None, UUID0, "15360", reserved=RESERVED))
    assert [r.code for r in decision.reasons] == ["limit-missing"] and "hamicore plugin off" in decision.reasons[0].message
    p["spec"]["containers"][0]["env"] = [{"name": "CUDA_DEVICE_MEMORY_LIMIT", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "CUDA_DEVICE_MEMORY_LIMIT"}}}]
    decision = decide(p, p["spec"]["containers"][0], Inputs(None, UUID0, "15360", reserved=RESERVED))
    assert "wrote none into its ConfigMap" in decision.reasons[0].message
