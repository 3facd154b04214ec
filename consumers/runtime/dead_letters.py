"""The dead-letter record for an input the pod cannot trust: the original, and why, where from, by whom.

A dead letter always fits under the record limit: a key, value or header set too large to copy
is cut, and the original's size and SHA-256 stand in for the part cut. A dead letter that could
not be produced would stop its partition, which is what dead-lettering exists to prevent.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from aiokafka import ConsumerRecord

from consumers.runtime.kafka.failures import RECORD_LIMIT_BYTES, record_size
from events.codec import EncodedRecord, Headers, header

#: What a dead letter keeps of the original's key and headers (a key is an id; headers are
#: metadata); the value gets the rest of the record limit.
KEY_KEPT_BYTES: Final = 4 * 1024
HEADERS_KEPT_BYTES: Final = 64 * 1024
REASON_KEPT_CHARS: Final = 4 * 1024
#: The start of the reason the pod gives an input stamped too far ahead of its own clock when it read
#: it (a producer whose clock runs ahead). The pod's clock is in no input, so ``replay`` takes such a
#: dead letter as recorded instead of deriving it.
AHEAD_OF_POD_CLOCK: Final = "meta.occurred_at is ahead of the pod's clock"


def ahead_of_pod_reason(ahead_s: float, allowed_s: float) -> str:
    return (
        f"{AHEAD_OF_POD_CLOCK} by {ahead_s:.0f}s when the pod read the record "
        f"(allowed: {allowed_s:g}s of clock skew; the producer's clock runs ahead)"
    )


#: Room for the size, hash and mark of a cut part.
_CUT_HEADERS_BYTES: Final = 256


def _cut(name: str, data: bytes, kept: int, headers: list[tuple[str, bytes]]) -> bytes:
    if len(data) <= kept:
        return data
    headers.append((f"dlq_{name}_size", str(len(data)).encode()))
    headers.append((f"dlq_{name}_sha256", hashlib.sha256(data).hexdigest().encode()))
    headers.append((f"dlq_{name}_truncated", b"true"))
    return data[:kept]


def bounded_reason(reason: str) -> str:
    if len(reason) <= REASON_KEPT_CHARS:
        return reason
    return f"{reason[:REASON_KEPT_CHARS]}… ({len(reason) - REASON_KEPT_CHARS} characters cut)"


@dataclass(frozen=True)
class Provenance:
    """What operators' tools read of a dead letter besides its place and reason (Kafka Connect's
    and Spring Kafka's error headers carry the same): the consumer group that gave it up, the
    exception behind it (none for a refusal by the rules), and how many times it was met."""

    group: str = ""
    error_class: str = ""
    error_message: str = ""
    attempts: int = 1


def _envelope(
    topic: str, partition: int, offset: int, reason: str, pod_id: str, why: Provenance | None = None
) -> list[tuple[str, bytes]]:
    headers = [
        ("dlq_reason", bounded_reason(reason).encode()),
        ("dlq_source_topic", topic.encode()),
        ("dlq_source_partition", str(partition).encode()),
        ("dlq_source_offset", str(offset).encode()),
        ("dlq_pod", pod_id.encode()),
    ]
    if why is not None:
        if why.group:
            headers.append(("dlq_consumer_group", why.group.encode()))
        if why.error_class:
            headers.append(("dlq_exception_class", why.error_class.encode()))
            headers.append(("dlq_exception_message", bounded_reason(why.error_message).encode()))
        headers.append(("dlq_attempts", str(why.attempts).encode()))
    return headers


def source_of_dead_letter(headers: Headers) -> tuple[str, int, int] | None:
    """The (topic, partition, offset) a dead letter's envelope names; None when it names no number."""
    try:
        return (
            header(headers, "dlq_source_topic") or "",
            int(header(headers, "dlq_source_partition") or -1),
            int(header(headers, "dlq_source_offset") or -1),
        )
    except ValueError:
        return None


def dead_letter_record(
    rec: ConsumerRecord[bytes, bytes], reason: str, pod_id: str, why: Provenance | None = None
) -> EncodedRecord:
    own = _envelope(rec.topic, rec.partition, rec.offset, reason, pod_id, why)
    copied: list[tuple[str, bytes]] = []
    room = HEADERS_KEPT_BYTES
    for name, value in rec.headers or ():
        size = len(name) + len(value or b"")
        if size > room:
            own.append(("dlq_headers_omitted", str(len(rec.headers) - len(copied)).encode()))
            break
        room -= size
        copied.append((name, value or b""))
    key = _cut("key", rec.key or b"", KEY_KEPT_BYTES, own)
    # Room for the value: the limit less the rest, and less the value's own cut headers.
    room = RECORD_LIMIT_BYTES - record_size(EncodedRecord(key, b"", [*copied, *own])) - _CUT_HEADERS_BYTES
    value = _cut("value", rec.value or b"", room, own)
    return EncodedRecord(key=key, value=value, headers=[*copied, *own])


def bare_dead_letter(
    rec: ConsumerRecord[bytes, bytes], reason: str, pod_id: str, why: Provenance | None = None
) -> EncodedRecord:
    """The smallest dead letter: where the record is, why, and its parts' sizes and hashes only.

    For a record whose full dead letter the dead-letter topic itself refused (its own size limit):
    a dead letter must always get through.
    """
    headers = _envelope(rec.topic, rec.partition, rec.offset, reason, pod_id, why)
    _cut("key", rec.key or b"", 0, headers)
    _cut("value", rec.value or b"", 0, headers)
    if rec.headers:
        headers.append(("dlq_headers_omitted", str(len(rec.headers)).encode()))
    return EncodedRecord(key=b"", value=b"", headers=headers)


def unparsable_dead_letter(
    topic: str, partition: int, offset: int, reason: str, pod_id: str, why: Provenance | None = None
) -> EncodedRecord:
    """For a record the Kafka client cannot parse: where it is and why; its bytes are out of reach."""
    headers = _envelope(topic, partition, offset, reason, pod_id, why)
    headers.append(("dlq_unparsable", b"true"))
    return EncodedRecord(key=b"", value=b"", headers=headers)
