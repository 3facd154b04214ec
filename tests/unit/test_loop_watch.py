"""Liveness that tells a dead loop from one waiting out the world (``consumers.runtime.loop_watch``).

The pure measure as a table; the watch through the loop's task and the tasks it starts (and not
through a task started outside the loop); the health a window judges; and a real librdkafka
producer's broker wait declared to the loop it runs for (no broker: an address nothing listens on).
"""

from __future__ import annotations

import asyncio

import pytest

from consumers.runtime.kafka.txn_producer import TxnProducer, group_metadata
from consumers.runtime.loop_watch import LoopWatch, Wait, bounded_wait, outside_the_loop, stalled_for
from consumers.runtime.pod_config import PodStats, assess_health
from consumers.tools.embedded_broker import free_port


@pytest.mark.parametrize(
    ("now", "moved_at", "waits", "stalled"),
    [
        (100.0, 60.0, [], 40.0),  # no wait: since the loop last moved
        (100.0, 60.0, [Wait("commit", 70.0, 110.0)], 0.0),  # inside a wait within its bound
        (100.0, 60.0, [Wait("commit", 70.0, 90.0)], 10.0),  # the wait outlived its bound by 10 s
        (100.0, 95.0, [Wait("commit", 70.0, 90.0)], 5.0),  # moved since the bound ran out
        (100.0, 60.0, [Wait("a", 61.0, 81.0), Wait("b", 62.0, 97.0)], 3.0),  # the latest bound covers
        (100.0, 100.0, [], 0.0),
    ],
)
def test_the_stand_still_is_what_no_declared_bound_covers(
    now: float, moved_at: float, waits: list[Wait], stalled: float
) -> None:
    assert stalled_for(now, moved_at, waits) == pytest.approx(stalled)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_counts_only_within_its_bound_and_only_for_the_loop() -> None:
    clock = Clock()
    watch = LoopWatch(clock)
    clock.now += 12
    assert watch.assess().stalled_s == pytest.approx(12)
    with bounded_wait("outside the loop", 60):  # no loop served here: a no-op
        assert watch.assess().waiting_for == ""
    with watch.serving():
        with bounded_wait("p3: commit_transaction", 20):
            clock.now += 19
            state = watch.assess()
            assert (state.since_turned_s, state.stalled_s) == (pytest.approx(31), 0.0)
            assert "p3: commit_transaction (19.0 s of its 20 s bound)" in state.waiting_for
            clock.now += 35  # 34 s past its bound: a loop stuck inside a call that should have ended
            assert watch.assess().stalled_s == pytest.approx(34)
        clock.now += 2  # the wait ended (the loop moved) 2 s ago
        state = watch.assess()
        assert (state.since_turned_s, state.stalled_s, state.waiting_for) == (
            pytest.approx(68),
            pytest.approx(2),
            "",
        )
        watch.turned()
        assert watch.assess().since_turned_s == 0.0


async def test_the_loops_tasks_inherit_the_watch_and_a_take_over_does_not() -> None:
    watch = LoopWatch()
    inside = asyncio.Event()
    release = asyncio.Event()

    async def transaction(what: str) -> None:  # a turn's per-partition transaction (gather)
        with bounded_wait(what, 60):
            inside.set()
            await release.wait()

    async def loop() -> None:
        with watch.serving():
            take_over = asyncio.get_running_loop().create_task(
                transaction("take-over"), context=outside_the_loop()
            )
            await asyncio.gather(transaction("p1"), transaction("p2"))
            await take_over

    task = asyncio.create_task(loop())
    await asyncio.wait_for(inside.wait(), 5)
    await asyncio.sleep(0)  # every task reached its wait
    waiting = watch.assess().waiting_for
    release.set()
    await asyncio.wait_for(task, 5)
    assert "p1" in waiting and "p2" in waiting, waiting
    assert "take-over" not in waiting, waiting
    assert watch.assess().waiting_for == ""


def _health(since_turned_s: float, stalled_s: float) -> tuple[bool, str]:
    health = assess_health(
        now=500.0,
        running=True,
        last_loop=500.0 - since_turned_s,
        stats=PodStats(),
        assigned=2,
        restoring=False,
        restored=True,
        stall_after_s=30.0,
        stalled_s=stalled_s,
    )
    assert health.seconds_since_loop == pytest.approx(since_turned_s)
    return health.alive, health.detail


def test_liveness_judges_the_stand_still_beyond_the_bounds_not_the_time_since_a_turn() -> None:
    assert _health(33.3, 0.0) == (True, "ok")  # 33 s in broker waits within their bounds: alive
    assert _health(45.0, 31.0) == (False, "loop stalled for 31.0s")
    assert _health(10.0, 10.0) == (True, "ok")


async def test_a_real_producers_broker_wait_is_declared_to_the_loop_it_runs_for() -> None:
    """librdkafka's InitProducerId towards an address nothing listens on waits its timeout; the loop
    that awaits it is inside a declared wait meanwhile, named and bounded by the producer's deadline."""
    port = free_port()  # closed again: connections are refused
    producer = TxnProducer(
        {"bootstrap.servers": f"127.0.0.1:{port}", "log_level": 0},
        "loop-watch-test-p0",
        group_metadata("loop-watch-test"),
        timeout_s=30.0,
    )
    watch = LoopWatch()

    async def loop() -> None:
        with watch.serving():
            await producer.init()

    task = asyncio.create_task(loop())
    try:
        state = watch.assess()
        for _ in range(100):  # the facts, with a deadline: the wait is registered once init awaits
            if state.waiting_for:
                break
            await asyncio.sleep(0.02)
            state = watch.assess()
        assert "loop-watch-test-p0: init_transactions" in state.waiting_for, state
        assert "35 s bound" in state.waiting_for  # the transaction timeout and the pod's grace
        assert state.stalled_s == 0.0
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        producer.close()
    assert watch.assess().waiting_for == ""


async def test_a_fetch_around_an_unparsable_record_held_by_the_client_is_let_go_and_declared() -> None:
    """aiokafka holds a fetch through a rebalance: the scan past a bad record lets it go past its
    timeout (nothing fetched: the reader meets the record again) and the loop declares the wait
    while it lasts. The real scan past bad records: tests/integration/test_bad_records.py."""
    from aiokafka import TopicPartition

    from consumers.runtime.kafka import unparsable

    watch = LoopWatch()
    seen: list[str] = []

    class HeldConsumer:
        async def getmany(self, *_: object, **__: object) -> dict[TopicPartition, list[object]]:
            seen.append(watch.assess().waiting_for)
            await asyncio.Event().wait()  # a rebalance that never settles
            raise AssertionError("unreachable")

    with watch.serving():
        got = await unparsable._fetch(HeldConsumer(), TopicPartition("in", 0), 50, 10)  # type: ignore[arg-type]
    assert got == {}
    assert seen and seen[0].startswith("a fetch around an unparsable record"), seen
    assert watch.assess().waiting_for == ""


async def test_a_call_given_up_on_has_its_late_answer_dropped_never_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A librdkafka call outliving its deadline: the producer gives up and cancels the call's future,
    so the answer the thread gives later is dropped. Retrieved by a callback instead (before), it was
    reported as 'Future exception was never retrieved' when the loop ended first (a pod stopping in
    a network fault: one ERROR line in test_network_faults)."""
    import threading

    from consumers.runtime.kafka import producer_thread

    producer = TxnProducer(
        {"bootstrap.servers": f"127.0.0.1:{free_port()}", "log_level": 0},
        "loop-watch-late-p0",
        group_metadata("loop-watch-late"),
        timeout_s=30.0,
    )
    futures: list[asyncio.Future[object]] = []
    submit = producer_thread.Worker.submit

    def kept(self: producer_thread.Worker, call: object) -> asyncio.Future[object]:
        future: asyncio.Future[object] = submit(self, call)  # type: ignore[arg-type]
        futures.append(future)
        return future

    monkeypatch.setattr(producer_thread.Worker, "submit", kept)
    release, answered = threading.Event(), threading.Event()

    def stuck() -> None:
        release.wait(10)
        answered.set()
        raise RuntimeError("the late answer")

    monkeypatch.setattr(producer, "deadline_s", 0.2)
    from consumers.runtime.kafka.producer_errors import BrokerWaitExpired

    with pytest.raises(BrokerWaitExpired):
        await producer._blocking(stuck)
    (future,) = futures
    assert future.cancelled()
    release.set()
    assert await asyncio.to_thread(answered.wait, 10)
    await asyncio.sleep(0.05)  # the thread's answer reaches the loop: dropped
    assert future.cancelled()
    producer.close()
