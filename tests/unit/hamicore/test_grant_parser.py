"""libvgpu.so's grant reader against the model that writes grants (shared/grant.py), differentially:
every grant the node agent can write is read back exactly, every input the reader accepts is a JSON
grant whose devices it read right, and no input (truncated, flipped, huge) reads past its bytes (the
driver runs under AddressSanitizer and UBSan)."""

from __future__ import annotations

import json
import struct
import subprocess
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kai_isolator.shared.grant import DeviceGrant, Grant, GrantSource
from vgpu_harness import TESTS_DIR

PARSER = TESTS_DIR / "grant_parse"
MAX_DEVICES = 15  # the reader's bound: the last accounting index is kept for devices outside the grant


def parse_in_c(texts: list[bytes]) -> list[str]:
    framed = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    done = subprocess.run([str(PARSER)], input=framed, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]  # a sanitizer report ends the run
    return done.stdout.decode().splitlines()


def expected_line(devices: list[tuple[str, int]]) -> str:
    return " ".join(["ok", str(len(devices)), *(f"{uuid.encode('latin-1').hex()}={limit}" for uuid, limit in devices)])


uuids = st.from_regex(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", fullmatch=True)
grants = st.builds(
    lambda devices, source, reason: Grant(pod_uid="u-1", namespace="ns", pod="p", container="main", source=source, reason=reason,
                                          devices=tuple(DeviceGrant(uuid=u, limit_bytes=b) for u, b in devices)),
    st.lists(st.tuples(uuids, st.integers(1, 2**64 - 1)), min_size=1, max_size=MAX_DEVICES, unique_by=lambda d: d[0].lower()),
    st.sampled_from(list(GrantSource)), st.text(max_size=40),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grant=grants, indent=st.sampled_from([None, 0, 2]))
def test_every_grant_the_node_agent_writes_is_read_back_exactly(grant: Grant, indent: int | None) -> None:
    texts = [grant.model_dump_json(indent=indent).encode()]
    texts.append(json.dumps(json.loads(texts[0]), sort_keys=True).encode())  # any key order
    wanted = expected_line([(d.uuid, d.limit_bytes) for d in grant.devices])
    assert parse_in_c(texts) == [wanted, wanted]


def accepted_devices(text: bytes) -> list[tuple[str, int]] | None:
    """What a correct reader takes from `text`, or None when it must refuse it (Python's JSON decoder
    as the reference; bytes as Latin-1, since the UTF-8 of a field the reader skips is not its to judge)."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if "devices" in keys and keys.count("devices") > 1 or "uuid" in keys and len(keys) != len(set(keys)):
            raise ValueError("duplicate key the reader refuses")
        return dict(items)

    try:
        doc = json.loads(text.decode("latin-1"), object_pairs_hook=pairs, parse_constant=lambda _: None)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or type(doc.get("version")) is not int or doc["version"] != 1:
        return None
    devices = doc.get("devices")
    if not isinstance(devices, list) or not 1 <= len(devices) <= MAX_DEVICES:
        return None
    found = []
    for device in devices:
        if not isinstance(device, dict) or set(device) != {"uuid", "limit_bytes"}:
            return None
        uuid, limit = device["uuid"], device["limit_bytes"]
        if not isinstance(uuid, str) or not uuid or type(limit) is not int or not 0 < limit < 2**64:
            return None
        found.append((uuid, limit))
    return found if len({u.lower() for u, _ in found}) == len(found) else None


def mutations(base: bytes) -> st.SearchStrategy[bytes]:
    position = st.integers(0, len(base))
    return st.one_of(
        position.map(lambda i: base[:i]),  # truncated
        st.tuples(position, st.binary(min_size=1, max_size=4)).map(lambda m: base[:m[0]] + m[1] + base[m[0]:]),  # inserted
        st.tuples(position, st.integers(1, 8)).map(lambda m: base[:m[0]] + base[m[0] + m[1]:]),  # deleted
        st.tuples(position, st.sampled_from([b'"', b"{", b"}", b"[", b"]", b",", b":", b"\\", b"-", b"9", b".", b"e", b" "]))
        .map(lambda m: base[:m[0]] + m[1] + base[m[0] + 1:]),  # a structural byte replaced
    )


BASE = Grant(pod_uid="u-1", namespace="ns", pod="p", container="main", source=GrantSource.CONFIGMAP,
             devices=(DeviceGrant(uuid="GPU-0000fa4e-1111-2222-3333-000000000000", limit_bytes=4348444672),
                      DeviceGrant(uuid="GPU-0100fa4e-1111-2222-3333-000000000001", limit_bytes=1 << 30))).model_dump_json().encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(mutations(BASE), min_size=8, max_size=8))
def test_whatever_the_reader_accepts_is_a_grant_it_read_right(batch: list[bytes]) -> None:
    # Refusing is always safe (every device closes); accepting is right only for a grant read right.
    for text, line in zip(batch, parse_in_c(batch)):
        if line != "malformed":
            devices = accepted_devices(text)
            assert devices is not None and line == expected_line(devices), (text, line)


def test_inputs_at_the_edges_of_the_format() -> None:
    uuid = '"GPU-0000fa4e-1111-2222-3333-000000000000"'
    cases: dict[str, tuple[str, Any]] = {
        "the largest limit": ('{"version":1,"devices":[{"uuid":%s,"limit_bytes":18446744073709551615}]}' % uuid, 2**64 - 1),
        "one past it": ('{"version":1,"devices":[{"uuid":%s,"limit_bytes":18446744073709551616}]}' % uuid, None),
        "sixteen devices": ('{"version":1,"devices":[%s]}' % ",".join(
            '{"uuid":"GPU-%02d","limit_bytes":1}' % i for i in range(16)), None),
        "a duplicate uuid, other case": ('{"version":1,"devices":[{"uuid":"GPU-AB","limit_bytes":1},{"uuid":"GPU-ab","limit_bytes":2}]}', None),
        "nested too deep": ('{"version":1,"x":' + "[" * 64 + "]" * 64 + ',"devices":[{"uuid":%s,"limit_bytes":1}]}' % uuid, None),
        "a uuid longer than any": ('{"version":1,"devices":[{"uuid":"GPU-%s","limit_bytes":1}]}' % ("f" * 200), None),
    }
    lines = parse_in_c([text.encode() for text, _ in cases.values()])
    for (name, (_, limit)), line in zip(cases.items(), lines):
        assert (line == "malformed") == (limit is None), (name, line)
        if limit is not None:
            assert line.endswith(f"={limit}"), (name, line)
