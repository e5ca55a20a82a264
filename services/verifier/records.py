"""The verifier's per-pod keys in its KV bucket: their names, which pods they list, and removing them.

A KV delete or purge leaves a marker as the key's last message, and the stream's subject index (what
`kv_keys` lists) shows a marker like a live key: a listing of `pod.>` would grow with every pod ever
seen, and a pass reading what it lists would read every one. So the verifier removes a forgotten
pod's keys from the stream itself (a purge of their subjects, as nats.go's `PurgeDeletes` does with
old markers) instead of purging them through the KV API: listings then hold live keys only, and a
pass costs what is live, not what was.
"""

from __future__ import annotations

from kai_isolator.shared.bus import Runtime
from kai_isolator.shared.events import PodIsolation

POD, VERDICT, PENDING, UNSEEN = "pod", "verdict", "pending", "unseen"
# Keyed by pod and container: `<kind>.<uid>.<container or ->` (container names hold no dots).
PER_CONTAINER = (VERDICT, PENDING, UNSEEN)


def pod_key(uid: str) -> str:
    return f"{POD}.{uid}"


def container_key(kind: str, pod: PodIsolation) -> str:
    return f"{kind}.{pod.pod.uid}.{pod.container or '-'}"


def uid_of(kind: str, key: str) -> str:
    """The pod uid in a key of `kind`; a uid may hold dots, a container name never does."""
    rest = key[len(kind) + 1:]
    return rest if kind == POD else rest.rsplit(".", 1)[0]


async def listed_uids(runtime: Runtime, bucket: str, kind: str) -> set[str]:
    """The uids of the pods with a key of `kind`: one request, whatever their number."""
    return {uid_of(kind, key) for key in await runtime.kv_keys(bucket, f"{kind}.>")}


async def remove(runtime: Runtime, bucket: str, pattern: str, before_revision: int | None = None) -> None:
    """Remove the messages of the keys matching `pattern` from the bucket's stream: no marker is left to list.

    With `before_revision`, only the messages older than it: a value written after the marker this
    removal was decided on is kept. A NATS error is raised (the caller retries).
    """
    await runtime.jetstream.purge_stream(f"KV_{bucket}", seq=before_revision, subject=f"$KV.{bucket}.{pattern}")


async def remove_pod(runtime: Runtime, bucket: str, uid: str) -> None:
    """Every key of the pod but its `gone.` tombstone, under any container."""
    await remove(runtime, bucket, pod_key(uid))
    await remove_container_keys(runtime, bucket, uid)


async def remove_container_keys(runtime: Runtime, bucket: str, uid: str) -> None:
    for kind in PER_CONTAINER:
        await remove(runtime, bucket, f"{kind}.{uid}.*")
