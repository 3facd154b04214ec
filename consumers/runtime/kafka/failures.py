"""Which failures a retry can cure, and how large a record the pod may produce.

A transaction that fails because of what a record *is* (its size, an encoding its
content cannot take) fails the same way on every retry: the pod retries it a few
times, then dead-letters the record and moves on. Those faults are an explicit list
(:data:`RECORD_FAULTS`); every other failure is the world's (the broker, the network,
a fence, a timeout, a missing ACL, a client's own trouble): the pod retries it with
backoff for ever and loses nothing. Kafka Streams draws the
same line with its production and processing exception handlers (KIP-210,
KIP-1033).
"""

from __future__ import annotations

from typing import Final

from aiokafka import errors as kafka_errors
from google.protobuf.message import Error as ProtobufError

from consumers.runtime.kafka.producer_errors import RecordRefused
from events.codec import DecodeError, EncodedRecord

#: The largest record the pod produces: aiokafka's default ``max_request_size`` (1,048,576 B) less
#: room for the batch and record framing. The broker's ``message.max.bytes`` default (1,048,588 B)
#: is above it.
RECORD_LIMIT_BYTES: Final = 1_000_000

#: Refusals of a record for its own content: the same record meets them again on every retry.
_KAFKA_RECORD_REFUSALS: Final = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
    # Not InvalidTimestampError: the pod sets no timestamp (librdkafka and aiokafka stamp its records
    # with the pod's clock), so a refused timestamp is a drifting pod clock, the world's to wait out.
    kafka_errors.CorruptRecordException,
    RecordRefused,
)
#: The record faults, all of them: a Kafka refusal of the record, bytes that do not decode as text
#: where text is required (aiokafka decodes header keys as UTF-8 while it iterates a fetch), and
#: content protobuf cannot encode or decode. Nothing else is the record's fault.
RECORD_FAULTS: Final = (*_KAFKA_RECORD_REFUSALS, UnicodeError, ProtobufError, DecodeError)


def is_deterministic(exc: BaseException) -> bool:
    """Will retrying the same records give the same failure? Only for a :data:`RECORD_FAULTS`.

    Everything else is the world: the broker, the network, a coordinator moving, a timeout, an
    authorization an operator fixes, a codec that is missing (a startup check names it first), and
    also what no list can foresee (a ``RuntimeError``, an ``AssertionError`` in a client, a
    ``CancelledError``, ``MemoryError``): retried with backoff, never charged to a record, so a
    valid record is never dead-lettered for the pod's own trouble. A client error raised *from* a
    record fault (aiokafka wraps some) counts as that fault.
    """
    if isinstance(exc, RECORD_FAULTS):
        return True
    cause = exc.__cause__
    return isinstance(exc, kafka_errors.KafkaError) and cause is not None and isinstance(cause, RECORD_FAULTS)


def record_size(record: EncodedRecord) -> int:
    """Bytes of key, value and headers (the framing is inside :data:`RECORD_LIMIT_BYTES`'s margin)."""
    return len(record.key) + len(record.value) + sum(len(k) + len(v) for k, v in record.headers)


def oversize_reason(what: str, record: EncodedRecord) -> str | None:
    """Why ``record`` cannot be produced, or None when it fits."""
    size = record_size(record)
    if size <= RECORD_LIMIT_BYTES:
        return None
    return f"{what} record of {size} bytes exceeds the {RECORD_LIMIT_BYTES}-byte record limit"
