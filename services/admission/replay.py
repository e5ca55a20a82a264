"""Answers replayed for AdmissionReviews that differ from one already decided only in `request.uid`:
what a controller sends when it creates many pods from one template, answered without a parse."""

from __future__ import annotations

import functools
import re

import orjson

from .answer import Answer
from .review import KIND, AdmissionRequest

# A uid spliced into and out of raw JSON must hold nothing JSON escapes or that ends a string.
_SPLICEABLE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
CAPACITY = 256
PER_KEY = 4  # workloads whose bodies share the bytes before the uid and the length
# Larger bodies are always decided in full: the templates hold at most CAPACITY * this many bytes.
MAX_BODY_BYTES = 64 * 1024


class Template:
    """One decided body cut at its uid: `prefix` + uid + `suffix` is answered `head` + uid + `tail`.

    It replays only once verified: a second body that matched it was parsed in full, carried its
    own uid exactly where the cut is, and was answered, record and all, just as the replay would."""

    __slots__ = ("key", "suffix", "uid", "head", "tail", "answer", "verified")

    def __init__(self, key: tuple[bytes, int], suffix: bytes, uid: bytes, head: bytes, tail: bytes, answer: Answer) -> None:
        self.key, self.suffix, self.uid = key, suffix, uid
        self.head, self.tail, self.answer = head, tail, answer
        self.verified = False

    def replay(self, uid: bytes) -> Answer:
        answer, record = self.answer, self.answer.record
        assert record is not None
        return Answer(answer.status, self.head + uid + self.tail, answer.content_type, type(record)(uid.decode(), *record[1:]))


class Replays:
    """A bounded set of templates, looked up by the bytes before the uid and the body's length."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._count = 0
        self._templates: dict[tuple[bytes, int], list[Template]] = {}
        self._prefix_lengths: dict[int, int] = {}  # how many templates cut at each offset (one, in practice)

    def __len__(self) -> int:
        return self._count

    def match(self, raw: bytes) -> tuple[Template, bytes] | None:
        """The template `raw` fits, and the uid it carries; None when none fits."""
        size = len(raw)
        for cut in self._prefix_lengths:
            for template in self._templates.get((raw[:cut], size), ()):
                if raw.endswith(template.suffix):
                    uid = raw[cut:size - len(template.suffix)]
                    return (template, uid) if _SPLICEABLE.fullmatch(uid) else None
        return None

    def learn(self, raw: bytes, request: AdmissionRequest, answer: Answer, fitted: tuple[Template, bytes] | None) -> None:
        """After a full decision: verify the template the body fitted, or cut a new one from it."""
        if fitted is not None:
            template, uid = fitted
            if uid == template.uid:
                return  # the same request again proves nothing about where the uid is
            if request.uid.encode() == uid and template.replay(uid) == answer:
                template.verified = True
            else:
                self._drop(template)
            return
        template = _cut(raw, request, answer)
        if template is not None:
            self._add(template)

    def _add(self, template: Template) -> None:
        same_key = self._templates.get(template.key, [])
        if len(same_key) >= PER_KEY:
            self._drop(same_key[0])
        while self._count >= self.capacity:
            self._drop(next(iter(self._templates.values()))[0])  # the oldest key's oldest
        self._templates.setdefault(template.key, []).append(template)
        self._count += 1
        cut = len(template.key[0])
        self._prefix_lengths[cut] = self._prefix_lengths.get(cut, 0) + 1

    def _drop(self, template: Template) -> None:
        same_key = self._templates.get(template.key)
        if same_key is None or template not in same_key:
            return
        same_key.remove(template)
        if not same_key:
            del self._templates[template.key]
        self._count -= 1
        cut = len(template.key[0])
        self._prefix_lengths[cut] -= 1
        if not self._prefix_lengths[cut]:
            del self._prefix_lengths[cut]


def _cut(raw: bytes, request: AdmissionRequest, answer: Answer) -> Template | None:
    """A template from a decided body, when its uid can be found verbatim in both body and answer."""
    uid = request.uid.encode()
    if answer.record is None or len(raw) > MAX_BODY_BYTES or not _SPLICEABLE.fullmatch(uid):
        return None
    start = raw.find(b'"' + uid + b'"') + 1
    if start == 0:
        return None
    head = _head(request.api_version)
    if not answer.body.startswith(head + uid + b'"'):
        return None
    end = start + len(uid)
    return Template((raw[:start], len(raw)), raw[end:], uid, head, answer.body[len(head) + len(uid):], answer)


@functools.lru_cache(maxsize=8)
def _head(api_version: str) -> bytes:
    """An answer's bytes up to its uid: `..."response":{"uid":"` (answer.py writes the uid first)."""
    return orjson.dumps({"apiVersion": api_version, "kind": KIND, "response": {"uid": ""}})[:-3]
