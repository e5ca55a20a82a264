"""The optional readiness gate: on the gated path an injected pod waits for the verifier's
Isolated condition before it is Ready; everything else about the decision stays the same."""

from __future__ import annotations

from types import SimpleNamespace

import jsonpatch

from kai_isolator.services.admission.injection import InjectionConfig
from kai_isolator.services.admission.webhook import Webhook
from kai_isolator.shared.operator_view import ISOLATED_CONDITION

GATE = {"conditionType": ISOLATED_CONDITION}


def gated(mode: str = "warn") -> Webhook:
    return Webhook(InjectionConfig(), mode, readiness_gate=True)  # type: ignore[arg-type]


def test_the_gated_path_adds_the_isolated_gate_once(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-fraction": "0.5"})
    patched = jsonpatch.apply_patch(pod, kit.patch_of(gated().handle(kit.review_of(pod))))
    assert patched["spec"]["readinessGates"] == [GATE]
    assert kit.patch_of(gated().handle(kit.review_of(patched))) == []  # idempotent, like every other op


def test_a_pods_own_gates_are_kept(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-memory": "4096"})
    pod["spec"]["readinessGates"] = [{"conditionType": "example.com/Warm"}]
    patched = jsonpatch.apply_patch(pod, kit.patch_of(gated().handle(kit.review_of(pod))))
    assert patched["spec"]["readinessGates"] == [{"conditionType": "example.com/Warm"}, GATE]


def test_the_plain_path_never_gates_and_pods_we_skip_are_never_gated(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-fraction": "0.5"})
    plain = jsonpatch.apply_patch(pod, kit.patch_of(Webhook(InjectionConfig(), "warn").handle(kit.review_of(pod))))
    assert "readinessGates" not in plain["spec"]
    for skipped in (kit.make_pod({}), kit.make_pod({"gpu-fraction": "0.5", "kai-resource-isolator.io/inject": "false"})):
        assert kit.patch_of(gated().handle(kit.review_of(skipped))) == []


def test_a_malformed_gate_list_is_a_clear_denial(kit: SimpleNamespace) -> None:
    pod = kit.make_pod({"gpu-fraction": "0.5"})
    pod["spec"]["readinessGates"] = "Isolated"
    response = kit.response_of(gated().handle(kit.review_of(pod)))
    assert response["allowed"] is False and "spec.readinessGates must be a list of objects" in response["status"]["message"]
