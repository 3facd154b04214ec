"""The loop turns while the group settles a rebalance (issue 42: the post-outage stand-still).

aiokafka holds ``getmany`` from the moment a member must rejoin until the group has given it its new
assignment, and the broker holds that join until every member has rejoined, up to the rebalance
timeout. After an outage the member that is late is the other pod, inside its own broker waits: the
pod's loop stood still all that time and its liveness measure counted it. The loop now lets a fetch
go past its timeout and turns without records.

On a real broker: a pod owns the inputs; a second member joins, with a revocation callback that
takes ``HOLD_S`` when it has partitions to give back; a third member joins, so the pod and the second
member must rejoin, and the broker holds the pod's join until the second member is done. The verdict
is the pod's own measure, sampled every 0.1 s: the time since its loop last turned stays short while
the group is settling (measured: the pod out of a settled generation for at least ``HOLD_S`` minus a
second, else the case was not exercised and the test fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from consumers.ops.settings import load_settings
from consumers.runtime.kafka.clients import group_joined
from tests.support.pod_harness import running_pod, unique_env

pytestmark = pytest.mark.kafka

#: How long the second member takes to give its partitions back (the other pod's broker wait).
HOLD_S = 12.0
#: The loop turns at least this often while the group settles (the fetch's timeout and its grace).
TURNED_WITHIN_S = 3.0


#: What the members and the pod did, when (printed with the verdict: diagnosis only).
EVENTS: list[tuple[float, str]] = []


class SlowToRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, name: str, hold: bool) -> None:
        self.name = name
        self.hold = hold
        self.held_at: float | None = None

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        EVENTS.append((time.monotonic(), f"{self.name} revoked {len(revoked)}"))
        if self.hold and revoked and self.held_at is None:
            self.held_at = time.monotonic()
            await asyncio.sleep(HOLD_S)  # the member's own slow revocation (schedule, not a verdict)
            EVENTS.append((time.monotonic(), f"{self.name} hold over"))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        EVENTS.append((time.monotonic(), f"{self.name} assigned {len(assigned)}"))


async def _wait_assigned(consumer: AIOKafkaConsumer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not consumer.assignment():
        assert time.monotonic() < deadline, "the member got no partitions"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(consumer.getmany(timeout_ms=200), 2)


@pytest.mark.timeout(180)
async def test_the_loop_turns_while_a_rebalance_waits_for_a_slow_member(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PROCESSING_GUARANTEE="exactly_once",
        SANDBOX_LANES_PARTITIONS="4",
        SANDBOX_LANES_SESSION_TIMEOUT_MS="10000",
    )
    settings = load_settings(env)
    EVENTS.clear()
    topics = list(settings.topics.consumed)

    def member(listener: ConsumerRebalanceListener | None) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap,
            group_id=settings.group_id,
            enable_auto_commit=False,
            session_timeout_ms=30_000,
            rebalance_timeout_ms=60_000,
            heartbeat_interval_ms=1_000,
            partition_assignment_strategy=(RangePartitionAssignor,),  # the pod's
        )
        consumer.subscribe(topics, listener=listener)
        return consumer

    async with running_pod(env) as composed:
        pod = composed.pod
        slow = SlowToRevoke("second", hold=True)
        second = member(slow)
        third = member(SlowToRevoke("third", hold=False))
        try:
            await second.start()
            await _wait_assigned(second, 60)  # the first rebalance: the pod gave partitions to it
            fetching = asyncio.create_task(_keep_fetching(second))
            joining = asyncio.create_task(_start_assigned(third, 90))  # its start waits for the join
            samples: list[tuple[float, float, bool]] = []
            deadline = time.monotonic() + 90
            # Until the third member has its partitions and the pod is settled again.
            while not (joining.done() and group_joined(pod.consumer)) and time.monotonic() < deadline:
                since = pod.health().seconds_since_loop  # the pod's own measure, as /healthz reports it
                joined = group_joined(pod.consumer)
                if not samples or samples[-1][2] != joined:
                    EVENTS.append((time.monotonic(), f"pod joined={joined}"))
                samples.append((time.monotonic(), since, joined))
                await asyncio.sleep(0.1)
            await joining
            fetching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fetching
        finally:
            await asyncio.gather(second.stop(), third.stop(), return_exceptions=True)

    assert slow.held_at is not None, "the second member never had partitions to give back"
    held_at = slow.held_at
    unsettled = [at - held_at for at, _, joined in samples if not joined]
    settled_again_s = max(unsettled, default=0.0)
    longest = max(since for at, since, _ in samples)
    text = (
        f"rebalance held {HOLD_S:g}s by a member's revocation; the pod out of a settled generation from "
        f"{min(unsettled, default=0.0):+.1f}s to {settled_again_s:+.1f}s of the hold ({len(samples)} samples); "
        f"its loop's longest time since a turn meanwhile {longest:.1f}s"
    )
    t0 = EVENTS[0][0] if EVENTS else 0.0
    print("\n" + text + "\n" + "; ".join(f"{at - t0:.1f}s {what}" for at, what in EVENTS))
    assert settled_again_s >= HOLD_S - 1, f"the pod's join was not held: the case was not exercised; {text}"
    assert longest < TURNED_WITHIN_S, f"the loop stood still {longest:.1f}s inside the rebalance"


async def _start_assigned(consumer: AIOKafkaConsumer, timeout_s: float) -> None:
    await consumer.start()
    await _wait_assigned(consumer, timeout_s)


async def _keep_fetching(consumer: AIOKafkaConsumer) -> None:
    """A member polls (its revocation callback runs inside the group's join, not here)."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(consumer.getmany(timeout_ms=200), 2)
