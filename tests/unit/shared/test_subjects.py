"""Subject names: built in one place, parsed back exactly, safe for every Kubernetes name."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kai_isolator.shared import subjects
from kai_isolator.shared.errors import DecodeError

dns_label = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z")
dns_subdomain = st.lists(dns_label, min_size=1, max_size=4).map(".".join)


@given(namespace=dns_label, pod=dns_subdomain, node=dns_subdomain)
def test_every_builder_round_trips_through_parse(namespace: str, pod: str, node: str) -> None:
    assert subjects.parse(subjects.admission(namespace)) == subjects.Subject("admission", namespace=namespace)
    for kind, build in (("pod", subjects.pod), ("health", subjects.health), ("usage", subjects.usage)):
        built = build(namespace, pod)
        assert built.count(".") == 3  # a dotted pod name stays one token
        assert subjects.parse(built) == subjects.Subject(kind, namespace=namespace, pod=pod)  # type: ignore[arg-type]
    assert subjects.parse(subjects.node_status(node)) == subjects.Subject("node-status", node=node)
    assert subjects.parse(subjects.node_inspect(node)) == subjects.Subject("inspect", node=node)
    assert subjects.parse(subjects.node_install(node)) == subjects.Subject("install", node=node)


def test_examples_read_as_documented() -> None:
    assert subjects.pod("team-a", "train.v2") == "isolator.pod.team-a.train_v2"
    assert subjects.node_status("ip-10-0-0-1.ec2.internal") == "isolator.node.ip-10-0-0-1_ec2_internal.status"
    assert subjects.dlq("watcher") == "isolator.dlq.watcher"


def test_event_subjects_are_in_the_stream_and_request_subjects_are_not() -> None:
    def captured(subject: str) -> bool:
        return any(_matches(pattern, subject) for pattern in subjects.STREAM_SUBJECTS)

    assert captured(subjects.pod("a", "b")) and captured(subjects.node_status("n")) and captured(subjects.dlq("s"))
    assert not captured(subjects.node_inspect("n")) and not captured(subjects.node_install("n"))


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


@pytest.mark.parametrize("bad", ["", "Team", "a b", "a*", "a>", "-a", "a_b", "x" * 254])
def test_names_that_are_not_kubernetes_names_are_refused(bad: str) -> None:
    with pytest.raises(DecodeError, match="not a Kubernetes name"):
        subjects.pod("ns", bad)


@pytest.mark.parametrize("bad", ["", "isolator", "other.pod.a.b", "isolator.pod.a", "isolator.node.n.reboot", "isolator.what.a"])
def test_foreign_subjects_do_not_parse(bad: str) -> None:
    with pytest.raises(DecodeError):
        subjects.parse(bad)
