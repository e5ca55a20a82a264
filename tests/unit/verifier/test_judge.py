"""Verdicts from observations: each rule, and the stability of the observation digest."""

from __future__ import annotations

import pytest

from kai_isolator.services.verifier.judge import judge, judge_unobservable, judge_without_inspection
from kai_isolator.shared.events import DeviceUsage, DriverCap, DriverDeviceUsage, InspectReply, PodIsolation, PodRef, ProcessReport

LIB = "/usr/local/vgpu/libvgpu.so"
POD = PodRef(namespace="team-a", name="train", uid="u-1")
GIB = 1 << 30
MIB = 1 << 20
GRANTED = 4147 << 20


def running(**changes: object) -> PodIsolation:
    fields = dict(pod=POD, resource_version="9", state="running", node_name="gpu-1", container="main", injected=True, expected_limit="4147m")
    return PodIsolation(**{**fields, **changes})  # type: ignore[arg-type]


def process(pid: int, **changes: object) -> ProcessReport:
    fields = dict(pid=pid, preload=LIB + "\n", library_mapped=True, library_version="abc123", memory_limit_env="4147m")
    return ProcessReport(**{**fields, **changes})  # type: ignore[arg-type]


def reply(*processes: ProcessReport, devices: list[DeviceUsage] | None = None) -> InspectReply:
    if devices is None:
        devices = [DeviceUsage(index=0, uuid="GPU-0", limit_bytes=GRANTED, used_bytes=GIB)]
    return InspectReply(node_name="gpu-1", pod=POD, container="main", found=True, processes=list(processes), devices=devices)


def codes(judgement) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.code for r in judgement.reasons]


def test_a_fully_isolated_container_is_verified() -> None:
    result = judge(running(), reply(process(10), process(11)), LIB)
    assert result.verdict == "verified" and result.reasons == ()


def test_limit_formats_are_compared_as_bytes() -> None:
    result = judge(running(expected_limit="4147m"), reply(process(10, memory_limit_env="4147Mi")), LIB)
    assert result.verdict == "verified"


@pytest.mark.parametrize(
    "pod, expected_codes",
    [
        (running(injected=False), ["not-injected"]),
        (running(expected_limit=None), ["no-limit-granted"]),
        (running(injected=False, expected_limit=None), ["not-injected", "no-limit-granted"]),
    ],
)
def test_missing_injection_or_limit_needs_no_inspection(pod: PodIsolation, expected_codes: list[str]) -> None:
    result = judge_without_inspection(pod)
    assert result is not None and result.verdict == "missing" and codes(result) == expected_codes


def test_no_preload_in_any_process_is_missing() -> None:
    result = judge(running(), reply(process(10, preload=None, library_mapped=False), process(11, preload="")), LIB)
    assert result.verdict == "missing" and codes(result) == ["no-preload"]


def test_preload_present_but_nothing_loaded_is_missing() -> None:
    result = judge(running(), reply(process(10, library_mapped=False)), LIB)
    assert result.verdict == "missing" and codes(result) == ["library-not-loaded"]


@pytest.mark.parametrize(
    "processes, devices, expected_codes",
    [
        ([process(10), process(11, library_mapped=False)], None, ["process-without-library"]),
        ([process(10), process(11, preload="/tmp/evil.so")], None, ["preload-mismatch"]),
        ([process(10), process(11, memory_limit_env=None)], None, ["limit-env-missing"]),
        ([process(10, memory_limit_env="15g")], None, ["limit-mismatch"]),
        ([process(10, memory_limit_env="garbage")], None, ["limit-mismatch"]),
        ([process(10)], [], ["usage-cache-missing"]),
        ([process(10)], [DeviceUsage(index=0, limit_bytes=0, used_bytes=0, unlimited=True)], ["usage-cache-unlimited"]),
        ([process(10)], [DeviceUsage(index=0, limit_bytes=8 * GIB, used_bytes=GIB)], ["usage-cache-limit-mismatch"]),
        ([process(10)], [DeviceUsage(index=0, limit_bytes=GRANTED, used_bytes=GRANTED + 1)], ["over-limit"]),
    ],
)
def test_partial_isolation_is_degraded_with_machine_readable_reasons(
    processes: list[ProcessReport], devices: list[DeviceUsage] | None, expected_codes: list[str]
) -> None:
    result = judge(running(), reply(*processes, devices=devices), LIB)
    assert result.verdict == "degraded" and codes(result) == expected_codes
    assert all(r.message for r in result.reasons)


def test_reasons_name_the_processes_concerned() -> None:
    result = judge(running(), reply(process(10), process(12, library_mapped=False), process(11, library_mapped=False)), LIB)
    assert result.reasons[0].message.startswith("pids 11,12 ")


def test_the_same_observation_has_the_same_digest_and_a_change_a_new_one() -> None:
    first = judge(running(), reply(process(10), process(11, library_mapped=False)), LIB)
    again = judge(running(resource_version="10"), reply(process(10), process(11, library_mapped=False)), LIB)
    healed = judge(running(), reply(process(10), process(11)), LIB)
    assert first.observation == again.observation
    assert first.observation != healed.observation


# --- identity, the grant, tampering, and containers never seen ------------------------------------


def test_a_decoy_of_the_same_name_is_library_not_ours_not_a_missing_library() -> None:
    decoy = process(11, library_mapped=False, library_version=None, library_not_ours="/usr/local/vgpu/libvgpu.so.0123456789abcdef")
    result = judge(running(), reply(process(10), decoy), LIB)
    assert result.verdict == "degraded" and codes(result) == ["library-not-ours"]
    assert "11" in result.reasons[0].message and "libvgpu.so.0123456789abcdef" in result.reasons[0].message
    only_decoys = judge(running(), reply(decoy), LIB)
    assert only_decoys.verdict == "degraded" and codes(only_decoys) == ["library-not-ours"]


def test_a_preload_file_that_is_not_the_nodes_is_a_mismatch_whatever_it_says() -> None:
    result = judge(running(), reply(process(10, preload_ours=True), process(11, preload_ours=False)), LIB)
    assert codes(result) == ["preload-mismatch"] and "11" in result.reasons[0].message
    assert codes(judge(running(), reply(process(10, preload_ours=False)), LIB)) == ["no-preload"]


def test_without_the_grant_mount_the_limit_comes_from_the_environment() -> None:
    result = judge(running(), reply(process(10, grant_mounted=False)), LIB)
    assert result.verdict == "degraded" and codes(result) == ["limit-from-env"]


def test_with_the_grant_mounted_the_environment_does_not_decide() -> None:
    cleared = process(10, grant_mounted=True, memory_limit_env=None)
    raised = process(11, grant_mounted=True, memory_limit_env="15g")
    assert judge(running(), reply(cleared, raised), LIB).verdict == "verified"


def test_a_tampered_accounting_file_is_degraded_and_says_how() -> None:
    tampered = reply(process(10)).model_copy(update={"usage_cache_tampered": ["pid 10 maps an accounting file that was deleted"]})
    result = judge(running(), tampered, LIB)
    assert result.verdict == "degraded" and codes(result) == ["usage-cache-tampered"]
    assert "deleted" in result.reasons[0].message


def test_unobservable_is_one_observation_whatever_the_counts() -> None:
    first, later = judge_unobservable(running(), 3, 30), judge_unobservable(running(), 3, 30)
    assert first.verdict == "degraded" and codes(first) == ["unobservable"] and first.observation == later.observation


def test_device_memory_in_a_process_without_the_library_is_missing_from_the_drivers_view() -> None:
    # pid 11 maps a decoy (not the node's library) and holds 2 GiB; pid 12 is a shell holding nothing.
    observed = reply(process(10, device_memory_bytes=GIB), process(11, library_mapped=False, library_not_ours="/usr/local/vgpu/libvgpu.so",
                                                                      device_memory_bytes=2 * GIB),
                     process(12, library_mapped=False, device_memory_bytes=0)).model_copy(update={"driver_view": True})
    result = judge(running(), observed, LIB)
    assert result.verdict == "missing" and codes(result) == ["process-without-library"]
    assert "11 (2147483648 bytes)" in result.reasons[0].message and "12" not in result.reasons[0].message


def test_without_the_drivers_view_a_process_without_the_library_stays_degraded() -> None:
    observed = reply(process(10), process(11, library_mapped=False, device_memory_bytes=None))
    result = judge(running(), observed, LIB)
    assert result.verdict == "degraded" and "process-without-library" in codes(result)


def driver(used: int, grant: int = GIB, allowance: int = 512 * MIB) -> DriverDeviceUsage:
    return DriverDeviceUsage(uuid="GPU-0", used_bytes=used, grant_bytes=grant, allowance_bytes=allowance)


def test_verified_means_the_driver_agrees_past_the_grant_is_breached_whatever_the_library_says() -> None:
    # Every process maps the library and its cache shows nothing wrong; the driver shows 2 GiB under a 1 GiB grant.
    over = reply(process(10, device_memory_bytes=GIB), process(11, device_memory_bytes=GIB)).model_copy(
        update={"driver_view": True, "driver_devices": [driver(2 * GIB)]})
    result = judge(running(), over, LIB)
    assert result.verdict == "breached" and codes(result) == ["driver-over-grant"]
    assert "2147483648 bytes, held to 1073741824 (+536870912" in result.reasons[0].message
    within = over.model_copy(update={"driver_devices": [driver(GIB + 512 * MIB)]})
    assert judge(running(), within, LIB).verdict == "verified"


def test_a_container_granted_nothing_is_breached_by_any_byte_and_the_smaller_limit_holds() -> None:
    sidecar = reply(process(10, device_memory_bytes=MIB)).model_copy(update={"driver_view": True, "driver_devices": [driver(MIB, 0, 0)]})
    assert judge(running(), sidecar, LIB).verdict == "breached"
    # The node's grant is larger than the scheduler's limit (512 MiB): the smaller one is what the container may hold.
    larger = reply(process(10, device_memory_bytes=GIB)).model_copy(update={"driver_view": True, "driver_devices": [driver(GIB + MIB, 2 * GIB, 0)]})
    assert judge(running(expected_limit="512m"), larger, LIB).verdict == "breached"


def test_the_verdict_names_how_the_container_is_held_and_the_driver_still_judges_a_capped_one() -> None:
    within = reply(process(10, device_memory_bytes=GIB)).model_copy(update={"driver_view": True, "driver_devices": [driver(GIB)]})
    assert judge(running(), within, LIB).held == "library-and-enforcer"
    capped = within.model_copy(update={"driver_caps": [DriverCap(uuid="GPU-0", hard_bytes=GIB)]})
    result = judge(running(), capped, LIB)
    assert (result.verdict, result.held) == ("verified", "driver-capped")
    assert result.observation != judge(running(), within, LIB).observation  # capped or not: a new observation
    # A cap read back does not hide what the driver shows: more than the grant is breached, capped or not.
    over = capped.model_copy(update={"driver_devices": [driver(2 * GIB)]})
    assert (judge(running(), over, LIB).verdict, judge(running(), over, LIB).held) == ("breached", "driver-capped")
    assert judge_without_inspection(running(injected=False)).held is None  # type: ignore[union-attr]
