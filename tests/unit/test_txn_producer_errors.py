"""librdkafka's errors in the pod's vocabulary: which a retry cures, which fence the writer.

The real paths are on the broker (tests/integration/test_zombie_fencing.py: a fenced commit;
tests/integration/test_bad_records.py: a record the dead-letter topic refuses for its size;
tests/integration/test_kafka_security.py: a missing ACL); these pin the translation of each class.
"""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    InvalidTimestampError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    TopicAuthorizationFailedError,
)
from confluent_kafka import KafkaError, KafkaException

from consumers.runtime.kafka.failures import is_deterministic
from consumers.runtime.kafka.producer_errors import FatalProducer, RecordRefused, TransactionError, translate


def _raised(code: int) -> BaseException:
    return translate(KafkaException(KafkaError(code, "from librdkafka")))


@pytest.mark.parametrize(
    "code", [KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH]
)
def test_every_fence_code_is_producer_fenced(code: int) -> None:
    assert isinstance(_raised(code), ProducerFenced)


@pytest.mark.parametrize(
    ("code", "cls", "deterministic"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, MessageSizeTooLargeError, True),
        (KafkaError._INVALID_ARG, RecordRefused, True),
        (KafkaError._BAD_MSG, RecordRefused, True),
        (KafkaError.INVALID_RECORD, RecordRefused, True),  # 87: aiokafka has no class (UnknownError)
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, TopicAuthorizationFailedError, False),
        (KafkaError.INVALID_TIMESTAMP, InvalidTimestampError, False),
        (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, OutOfOrderSequenceNumber, False),
        (KafkaError._MSG_TIMED_OUT, TransactionError, False),
        (KafkaError._TRANSPORT, TransactionError, False),
    ],
)
def test_a_record_refusal_is_deterministic_and_the_world_is_not(
    code: int, cls: type[BaseException], deterministic: bool
) -> None:
    error = _raised(code)
    assert type(error) is cls
    assert is_deterministic(error) is deterministic
    assert "from librdkafka" in str(error)


def test_what_is_not_librdkafkas_passes_through() -> None:
    error = ValueError("ours")
    assert translate(error) is error


def test_a_fatal_producer_stands_down_as_fenced() -> None:
    """After a fence librdkafka answers produce() with _FATAL (the fence only in its log): read as a
    fence, so the pod rejoins instead of taking the partition over anew (which would fence its new
    owner)."""
    error = _raised(KafkaError._FATAL)
    assert isinstance(error, FatalProducer) and isinstance(error, ProducerFenced)
    assert not is_deterministic(error)


def test_a_refused_timestamp_is_the_pods_clock_not_the_records() -> None:
    """The pod sets no timestamp on what it produces (the clients stamp it with the pod's clock), so
    a broker refusing the timestamp (``message.timestamp.*.max.ms``) speaks of a drifting pod clock:
    dead-lettering would throw valid inputs away; it is waited out (the world's) instead, from either
    client, also when a client wraps it."""
    assert not is_deterministic(InvalidTimestampError("timestamp out of range"))
    try:
        raise TransactionError("commit failed") from InvalidTimestampError("timestamp out of range")
    except TransactionError as wrapped:
        assert not is_deterministic(wrapped)
    # The neighbours of the line that was removed are still record faults.
    assert is_deterministic(MessageSizeTooLargeError("too large"))
