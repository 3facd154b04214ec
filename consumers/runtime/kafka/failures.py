"""Which failures a retry can cure, and how large a record the pod may produce.

A transaction that fails because of what a record *is* (its size, an encoding its
content cannot take, a bug it triggers) fails the same way on every retry: the
pod retries it a few times, then dead-letters the record and moves on. A failure
of the world (the broker, the network, a fence, a timeout, a missing ACL) may
pass: the pod retries it for ever and loses nothing. Kafka Streams draws the
same line with its production and processing exception handlers (KIP-210,
KIP-1033).
"""

from __future__ import annotations

from typing import Final

from aiokafka import errors as kafka_errors

from consumers.runtime.kafka.txn_producer import RecordRefused
from events.codec import EncodedRecord

#: The largest record the pod produces: aiokafka's default ``max_request_size`` (1,048,576 B) less
#: room for the batch and record framing. The broker's ``message.max.bytes`` default (1,048,588 B)
#: is above it.
RECORD_LIMIT_BYTES: Final = 1_000_000

#: Refusals of a record for its own content: the same record meets them again on every retry.
_RECORD_ERRORS: Final = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTimestampError,
    kafka_errors.CorruptRecordException,
    kafka_errors.UnsupportedCodecError,
    RecordRefused,
)


def is_deterministic(exc: BaseException) -> bool:
    """Will retrying the same records give the same failure?

    Kafka's record refusals: yes. Every other Kafka error, an OS error or a timeout is the world
    (retried without end: authorization errors too, which an operator fixes). Anything else was
    raised by the pod's own code on this content (an encoding it cannot take, a bug): yes.
    """
    if isinstance(exc, _RECORD_ERRORS):
        return True
    return not isinstance(exc, kafka_errors.KafkaError | OSError | TimeoutError)


def record_size(record: EncodedRecord) -> int:
    """Bytes of key, value and headers (the framing is inside :data:`RECORD_LIMIT_BYTES`'s margin)."""
    return len(record.key) + len(record.value) + sum(len(k) + len(v) for k, v in record.headers)


def oversize_reason(what: str, record: EncodedRecord) -> str | None:
    """Why ``record`` cannot be produced, or None when it fits."""
    size = record_size(record)
    if size <= RECORD_LIMIT_BYTES:
        return None
    return f"{what} record of {size} bytes exceeds the {RECORD_LIMIT_BYTES}-byte record limit"
