"""The simulated kubelet keeps a pod's step through a failing API server, as a kubelet's status manager does."""

from __future__ import annotations

from typing import Any

import pytest

from kai_isolator.services.devcluster import kubelet
from kai_isolator.services.devcluster.plane import ApiCallError

POD = {"metadata": {"namespace": "team-a", "name": "job", "uid": "u-1"},
       "spec": {"containers": [{"name": "main", "image": "busybox"}]}, "status": {"phase": "Pending"}}


class FlakyApi:
    """Answers each call with the next of `answers`: an exception is raised, anything else returned."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "") -> Any:
        self.calls.append((method, path))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def run_step(api: FlakyApi) -> None:
    """The kubelet's Pending -> Running step for POD, at once."""
    await kubelet.SimulatedKubelet(api, "node-a", step_s=0)._run_later(POD)  # type: ignore[arg-type]


def unavailable(method: str) -> ApiCallError:
    return ApiCallError(method, "/api/v1/...", 503, {"message": "etcdserver: leader changed"})


async def test_a_pod_goes_running_although_the_api_server_failed_the_first_calls() -> None:
    api = FlakyApi(unavailable("GET"), ConnectionResetError("reset"), POD, unavailable("PATCH"), {})
    await run_step(api)
    assert api.calls[-1] == ("PATCH", "/api/v1/namespaces/team-a/pods/job/status")
    assert [m for m, _ in api.calls] == ["GET", "GET", "GET", "PATCH", "PATCH"]


async def test_a_pod_deleted_meanwhile_is_left_alone() -> None:
    api = FlakyApi(ApiCallError("GET", "/api/v1/...", 404, {"message": "not found"}))
    await run_step(api)
    assert api.calls == [("GET", "/api/v1/namespaces/team-a/pods/job")]


async def test_a_refusal_is_not_retried() -> None:
    api = FlakyApi(POD, ApiCallError("PATCH", "/api/v1/...", 422, {"message": "invalid"}))
    with pytest.raises(ApiCallError, match="422"):
        await run_step(api)
    assert len(api.calls) == 2


async def test_an_api_server_that_never_comes_back_fails_the_step_in_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubelet, "STEP_RETRY_S", 0.5)
    api = FlakyApi(*[unavailable("GET")] * 50)
    with pytest.raises(ApiCallError, match="503"):
        await run_step(api)
    assert 2 <= len(api.calls) < 10


async def test_a_node_authorizer_behind_the_binding_is_waited_out() -> None:
    """The Node authorizer learns of a binding from its own watch: for a moment it refuses the bound node its own pod."""
    lagging = ApiCallError("GET", "/api/v1/...", 403, {"message": 'pods "job" is forbidden: User "system:node:node-a" cannot get resource '
                                                       '"pods" in API group "" in the namespace "team-a": node: no relationship found '
                                                       "between node 'node-a' and this object"})
    api = FlakyApi(lagging, POD, {})
    await run_step(api)
    assert [m for m, _ in api.calls] == ["GET", "GET", "PATCH"]


async def test_any_other_forbidden_is_a_refusal() -> None:
    api = FlakyApi(ApiCallError("GET", "/api/v1/...", 403, {"message": 'pods "job" is forbidden: RBAC: access denied'}))
    with pytest.raises(ApiCallError, match="403"):
        await run_step(api)
    assert len(api.calls) == 1
