"""Abandoned producers cannot pile up: closed ones still stuck in a broker wait are counted, and
past the cap no new producer is opened (issue 42, finding 7)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from consumers.runtime.failure_policy import Fault, classify
from consumers.runtime.kafka import txn_producer
from consumers.runtime.kafka.sink import PartitionSinks
from consumers.runtime.kafka.txn_producer import MAX_LINGERING, TooManyLingering, lingering


@pytest.fixture
def stuck() -> Iterator[threading.Event]:
    """MAX_LINGERING closed producers whose threads wait (as a worker stuck in librdkafka would)."""
    release = threading.Event()
    threads = []
    for _ in range(MAX_LINGERING):
        worker = threading.Thread(target=release.wait, daemon=True)
        closer = threading.Thread(target=release.wait, daemon=True)
        worker.start()
        closer.start()
        threads += [worker, closer]
        txn_producer._LINGERING.append((worker, closer))
    yield release
    release.set()
    for t in threads:
        t.join(5)
    lingering()


async def test_past_the_cap_no_producer_is_opened_until_some_have_ended(stuck: threading.Event) -> None:
    assert lingering() == MAX_LINGERING
    sinks = PartitionSinks(None, "g", "exactly_once", {}, txn_config={"bootstrap.servers": "127.0.0.1:1"})  # type: ignore[arg-type]
    with pytest.raises(TooManyLingering) as refused:
        await sinks.open({0})
    assert sinks.get(0) is None
    assert classify(refused.value) is Fault.WORLD  # waited out with the take-over's backoff
    stuck.set()
    for worker, closer in list(txn_producer._LINGERING):
        worker.join(5)
        closer.join(5)
    assert lingering() == 0
