"""How the stable offset read answers each kind of reply (``consumers.runtime.kafka.stable_offsets``).

The broker's side is pinned on a real broker (tests/integration/test_stable_offsets.py); here a stand-in
for librdkafka's admin client gives the replies a real broker gives only in faults: a coordinator still
loading, offsets unstable past the deadline, a refusal, a partition left out of the answer. And where
the client is destroyed: in the read's own thread, never on the event loop, whichever way it ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import GroupAuthorizationFailedError
from confluent_kafka import KafkaError, KafkaException

from consumers.runtime.kafka import stable_offsets
from consumers.runtime.kafka.producer_errors import TransactionError
from consumers.runtime.kafka.stable_offsets import StableOffsets, StillUnstable, Unstable

GROUP = "g"
TP0, TP1 = TopicPartition("in", 0), TopicPartition("in", 1)


class FakeAdmin:
    """Answers from a script, one reply per request; records the thread each handle dies in."""

    script: ClassVar[list[Any]] = []
    destroyed_in: ClassVar[list[str]] = []
    polled = 0

    def __init__(self, config: dict[str, Any]) -> None:
        assert config["logger"] is stable_offsets.logger  # its log lines go to the pod's logger

    def poll(self, timeout: float) -> int:
        FakeAdmin.polled += 1
        return 0

    def list_consumer_group_offsets(self, requests: list[Any], **kwargs: Any) -> dict[str, Future[Any]]:
        assert kwargs["require_stable"] is True
        reply = FakeAdmin.script.pop(0) if len(FakeAdmin.script) > 1 else FakeAdmin.script[0]
        future: Future[Any] = Future()
        if isinstance(reply, KafkaError):
            future.set_exception(KafkaException(reply))
        else:
            future.set_result(SimpleNamespace(topic_partitions=reply))
        return {requests[0].group_id: future}

    def __del__(self) -> None:
        FakeAdmin.destroyed_in.append(threading.current_thread().name)


def _tp(partition: int, offset: int, error: KafkaError | None = None) -> SimpleNamespace:
    return SimpleNamespace(topic="in", partition=partition, offset=offset, error=error)


@pytest.fixture(autouse=True)
def fake_admin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(stable_offsets, "AdminClient", FakeAdmin)
    FakeAdmin.script, FakeAdmin.destroyed_in, FakeAdmin.polled = [], [], 0
    yield


async def test_a_coordinator_loading_then_unstable_is_asked_again_until_answered() -> None:
    FakeAdmin.script = [
        KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS),
        [_tp(0, -1001), _tp(1, 7, KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT))],
        [_tp(1, 9), _tp(0, -1001)],  # any order; -1001 is "none committed"
    ]
    reader = StableOffsets({}, GROUP, timeout_s=5.0)
    assert await reader.read([TP0, TP1]) == [None, 9]
    assert reader.asked_again == 2
    assert FakeAdmin.polled >= 2  # before the first request (a token callback) and after
    assert FakeAdmin.destroyed_in == ["sandbox-lanes-stable-offsets"]


async def test_offsets_unstable_past_the_deadline_fail_as_the_worlds_with_the_last_answer() -> None:
    FakeAdmin.script = [[_tp(0, 3, KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT))]]
    reader = StableOffsets({}, GROUP, timeout_s=0.3)
    with pytest.raises(StillUnstable, match="UNSTABLE_OFFSET_COMMIT"):
        await reader.read([TP0])
    assert isinstance(StillUnstable(""), TransactionError)  # the failure policy's "world"
    assert reader.asked_again >= 3
    assert FakeAdmin.destroyed_in == ["sandbox-lanes-stable-offsets"]


async def test_read_once_says_unstable_and_does_not_ask_again() -> None:
    FakeAdmin.script = [[_tp(0, 3, KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT))], [_tp(0, 4)]]
    with pytest.raises(Unstable):
        await StableOffsets({}, GROUP, timeout_s=5.0).read_once([TP0])
    assert FakeAdmin.script == [[_tp(0, 4)]]  # one request only


async def test_a_refusal_is_raised_as_aiokafkas_class_and_the_handle_still_dies_in_its_thread() -> None:
    FakeAdmin.script = [[_tp(0, -1001, KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED))]]
    with pytest.raises(GroupAuthorizationFailedError):
        await StableOffsets({}, GROUP, timeout_s=5.0).read([TP0])
    assert FakeAdmin.destroyed_in == ["sandbox-lanes-stable-offsets"]


async def test_a_partition_missing_from_the_answer_is_a_failure_not_none() -> None:
    FakeAdmin.script = [[_tp(0, 4)]]
    with pytest.raises(TransactionError, match=r"in \[1\]"):
        await StableOffsets({}, GROUP, timeout_s=5.0).read([TP0, TP1])


async def test_nothing_asked_for_nothing() -> None:
    assert await StableOffsets({}, GROUP, timeout_s=5.0).read([]) == []
    assert FakeAdmin.destroyed_in == []
