"""Which failures are a record's (dead-lettered after a few attempts) and which the world's
(waited out for ever), the episode log of the world's, and a record's type against its topic."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from aiokafka.errors import (
    CorruptRecordException,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotCoordinatorForGroupError,
    TopicAuthorizationFailedError,
    UnsupportedCodecError,
)
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import EncodeError

from consumers.runtime.kafka.failures import is_deterministic
from consumers.runtime.kafka.producer_errors import BrokerWaitExpired, RecordRefused
from consumers.runtime.kafka.topology import Topics
from events.codec import DecodeError, decode_input, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from resilience.episode import Episode


def _wrapped(cause: BaseException) -> KafkaError:
    try:
        raise KafkaError("Unexpected error during data retrieval") from cause
    except KafkaError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        MessageSizeTooLargeError("x"),
        CorruptRecordException("Invalid CRC"),
        RecordRefused("bad arg"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        UnicodeEncodeError("ascii", "é", 0, 1, "no"),
        ProtobufDecodeError("truncated"),
        EncodeError("missing required"),
        DecodeError("missing ce_type header"),
        _wrapped(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "header key")),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_record_fault_is_deterministic(exc: BaseException) -> None:
    assert is_deterministic(exc)


@pytest.mark.parametrize(
    "exc",
    [
        # the world that Kafka names
        KafkaConnectionError("down"),
        NotCoordinatorForGroupError(),
        TopicAuthorizationFailedError("input"),
        KafkaTimeoutError(),
        BrokerWaitExpired("send_offsets_to_transaction did not return"),
        OSError("reset"),
        TimeoutError(),
        # a codec missing at run time (the startup check names it first): not the record's fault
        UnsupportedCodecError("lz4"),
        # what no list foresees: a client's own trouble, never charged to a record
        asyncio.CancelledError(),
        AssertionError("highwater of an unassigned partition"),
        RuntimeError("Event loop is closed"),
        MemoryError(),
        _wrapped(RuntimeError("fetcher routine")),
    ],
    ids=lambda e: type(e).__name__,
)
def test_everything_else_is_the_world(exc: BaseException) -> None:
    assert not is_deterministic(exc)


def test_an_episode_logs_its_start_and_its_end_once_and_backs_off(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.episode")
    now = [100.0]
    episode = Episode(
        "fetching",
        log,
        first_delay_s=0.1,
        max_delay_s=1.0,
        settle_s=10.0,
        clock=lambda: now[0],
        rng=lambda: 0.0,
    )
    with caplog.at_level(logging.INFO, logger="test.episode"):
        delays = [episode.failed(KafkaConnectionError(f"down {i}")) for i in range(6)]
        episode.recovered()  # a success: the backoff starts over, the episode is not over yet
        now[0] += 3.0
        assert episode.failed(KafkaConnectionError("down again")) == 0.1
        now[0] += 9.9
        episode.recovered()  # 9.9 s without a failure: still the same episode
        now[0] += 0.1
        episode.recovered()  # 10 s: it ends, logged once
        episode.recovered()  # no episode: nothing logged
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["fetching failed; retrying with backoff until it succeeds", "fetching recovered"]
    assert caplog.records[0].error == "KafkaConnectionError: down 0"  # type: ignore[attr-defined]
    assert caplog.records[1].attempts == 7  # type: ignore[attr-defined]
    assert caplog.records[1].seconds == 3.0  # type: ignore[attr-defined]
    assert not episode.ongoing
    assert episode.failed(KafkaConnectionError("again")) == 0.1  # a new episode starts over


def _phase_changed() -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(event_id="ev-9", source="producer-a"),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id="wfx_1",
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )


def test_each_input_topic_carries_one_type() -> None:
    topics = Topics()
    assert topics.carries("execution-created") == "sandbox_lanes.v1.ExecutionCreated"
    assert topics.carries("phase-changed") == "sandbox_lanes.v1.PhaseChanged"
    assert topics.carries("session-deleted") == "sandbox_lanes.v1.SessionDeleted"
    assert topics.carries("sandbox-outcomes") is None


def test_a_phase_change_labelled_session_deleted_is_refused_by_its_topic() -> None:
    record = encode(_phase_changed())
    labelled = [(k, b"sandbox_lanes.v1.SessionDeleted" if k == "ce_type" else v) for k, v in record.headers]
    # Without the topic's word it decodes: protobuf skips what SessionDeleted does not know.
    assert isinstance(decode_input(record.key, record.value, labelled), inputs_pb2.SessionDeleted)
    topics = Topics()
    with pytest.raises(
        DecodeError, match=re.escape("on a topic that carries 'sandbox_lanes.v1.PhaseChanged' only")
    ):
        decode_input(record.key, record.value, labelled, topic_carries=topics.carries("phase-changed"))
    with pytest.raises(DecodeError, match=re.escape("carries 'sandbox_lanes.v1.ExecutionCreated' only")):
        decode_input(
            record.key, record.value, record.headers, topic_carries=topics.carries("execution-created")
        )
    assert decode_input(
        record.key, record.value, record.headers, topic_carries=topics.carries("phase-changed")
    )
