"""What `kubectl isolator` reads back from the pod condition our services write, for a pod outside GPU sharing too."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from kai_isolator.services.kubectl_plugin import views
from kai_isolator.shared.operator_view import (
    ISOLATED_CONDITION, NODE_VIEW_ANNOTATION, NodeAgentView, condition_message, container_of_condition,
)


def test_the_condition_names_the_container_it_judged() -> None:
    for container in ("cuda", "id:0123456789ab"):
        message = condition_message("breached", container, [("over-grant", "device GPU-1: the driver shows 10737418240 bytes")])
        assert container_of_condition(message) == container
    assert container_of_condition(condition_message("verified", "main", [])) == "main"
    assert container_of_condition("someone else's words: container x") is None


def test_a_plain_pod_caught_on_a_shared_gpu_is_shown_by_namespace_pod_and_container() -> None:
    message = condition_message("breached", "attacker", [("over-grant", "held to 0 bytes"), ("killed", "killed pids 4242")])
    pod = {"metadata": {"namespace": "tenant", "name": "plain-all", "uid": "u1"},
           "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "app"}, {"name": "attacker"}]},
           "status": {"phase": "Running", "conditions": [{"type": ISOLATED_CONDITION, "status": "False", "reason": "over-grant",
                                                          "message": message}]}}
    assert views.tracked(pod)
    row = views.container_row(pod, [], {}, {})
    assert (row.namespace, row.pod, row.container, row.verdict, row.reason) == ("tenant", "plain-all", "attacker", "breached", "over-grant")
    assert row.requested == "" and views.has_problem([row])
    story = views.story(pod, [], {}, {})
    assert [e.what for e in story.story][:2] == ["Created", "OutsideGpuSharing"]


def test_a_nodes_row_shows_how_it_holds_grants_and_an_older_agents_view_reads_as_library_and_enforcer() -> None:
    now = datetime.now(timezone.utc)

    def node(view: str) -> dict[str, object]:
        return {"metadata": {"name": "gpu-1", "annotations": {NODE_VIEW_ANNOTATION: view}}}

    capped = NodeAgentView(node="gpu-1", last_seen=now, ready=True, mode="driver-capped").model_dump_json()
    assert views.node_row(node(capped), now).mode == "driver-capped"
    older = NodeAgentView(node="gpu-1", last_seen=now, ready=True).model_dump(mode="json")
    del older["mode"]  # written by a verifier from before the mode was shown
    assert views.node_row(node(json.dumps(older)), now).mode == "library-and-enforcer"
