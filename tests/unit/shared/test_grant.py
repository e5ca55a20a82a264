"""The grant model and the recomputation of KAI's binder limit from a pod's annotations."""

import pytest

from kai_isolator.shared.errors import ConfigError
from kai_isolator.shared.grant import (
    DeviceGrant, Grant, GrantSource, annotation_limit_bytes, binder_limit_mib, binder_portion, grant_dir_name,
)


@pytest.mark.parametrize(("annotations", "label", "portion", "limit_mib"), [
    ({"gpu-memory": "4096"}, 15360, "0.27", 4147),        # the docs' T4 example
    ({"gpu-memory": "4096"}, 16384, "0.26", 4259),        # the blog post's ConfigMap
    ({"gpu-memory": "2000"}, 11264, "0.18", 2027),        # KAI PR #2033's e2e log
    ({"gpu-fraction": "0.5"}, 81559, "0.50", 40779),      # KAI issue #2156
    ({"gpu-memory": "7680"}, 15360, "0.51", 7833),
    ({"gpu-memory": "20480"}, 40960, "0.51", 20889),
    ({"gpu-fraction": "0.333"}, 15360, "0.33", 5068),
])
def test_binder_recomputation_matches_kai(annotations, label, portion, limit_mib):
    assert binder_portion(annotations, label) == portion
    assert binder_limit_mib(label, portion) == limit_mib
    assert annotation_limit_bytes(annotations, label) == limit_mib << 20


@pytest.mark.parametrize(("annotations", "label"), [
    ({"gpu-fraction": "0.001"}, 15360),   # "%.2f" gives 0.00: KAI leaves such a pod without a limit
    ({"gpu-fraction": "abc"}, 15360),
    ({"gpu-fraction": "-0.5"}, 15360),
    ({"gpu-memory": "nan"}, 15360),
    ({"gpu-memory": "4096"}, 0),
    ({}, 15360),
])
def test_binder_recomputation_refuses_what_kai_cannot_compute(annotations, label):
    with pytest.raises(ConfigError):
        annotation_limit_bytes(annotations, label)


def test_grant_round_trips_and_rejects_garbage():
    grant = Grant(pod_uid="u-1", namespace="ns", pod="p", container="c",
                  devices=(DeviceGrant(uuid="GPU-1", limit_bytes=4147 << 20),), source=GrantSource.CONFIGMAP)
    assert Grant.model_validate_json(grant.model_dump_json()) == grant
    with pytest.raises(ValueError):
        Grant.model_validate({**grant.model_dump(), "devices": []})
    with pytest.raises(ValueError):
        DeviceGrant(uuid="GPU-1", limit_bytes=0)
    assert grant_dir_name("u-1", "c") == "u-1_c"
