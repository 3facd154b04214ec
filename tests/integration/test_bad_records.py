"""No record can stop a partition (issue 25), on the real broker.

Each case writes one bad record and then an ordinary workflow create on the same partition (one
partition per input topic, as a pod that owns everything would see it). The ordinary create must
get its ``SandboxProvisioned``, and the bad record must be in the dead-letter topic with its
reason and its place (topic, partition, offset). One pod serves every case, in turn, so a case
that stopped the partition would also stop every case after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from consumers.ops.compose import Composed
from consumers.ops.settings import load_settings
from consumers.runtime.dead_letters import KEY_KEPT_BYTES
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.tools.replay.command import lane_config
from consumers.tools.replay.derive import replay
from events.codec import encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.pod_harness import (
    ROOT,
    Received,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
    wf_terminal,
)

pytestmark = pytest.mark.kafka

#: 9999-12-31T23:59:59Z + 1 s: past protobuf's Timestamp range.
PAST_9999 = 253_402_300_800
#: A second in the year 9000 (inside the range, far ahead of any broker clock).
YEAR_9000 = 221_845_392_000


async def _create_state_topic(bootstrap: str, env: dict[str, str], configs: dict[str, str]) -> None:
    """The state topic with ``configs`` (the inputs come from the harness, as the producing side's)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        state = load_settings(env).topics.state
        await admin.create_topics(
            [NewTopic(state, 1, 1, topic_configs={"cleanup.policy": "compact", **configs})]
        )
    finally:
        await admin.close()


def _one_partition_env(bootstrap: str, tmp_path: Path, **overrides: str) -> dict[str, str]:
    """A pod that owns everything: one partition per input topic, the memory driver."""
    return unique_env(
        bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1", **overrides
    )


@pytest_asyncio.fixture
async def pod(kafka_bootstrap: str, tmp_path: Path) -> AsyncIterator[tuple[Composed, dict[str, str]]]:
    env = _one_partition_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_DEAD_LETTER_ATTEMPTS="2")
    # The state topic refuses records over 20 kB: an input that passes the edge but whose state
    # is larger fails its transaction at the broker, the same way on every retry.
    await _create_state_topic(kafka_bootstrap, env, {"max.message.bytes": "20000"})
    async with running_pod(env) as composed:
        yield composed, env


async def _send(
    bootstrap: str, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]]
) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=4 << 20)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, value, key=key, headers=headers)
        return int(meta.offset)
    finally:
        await producer.stop()


async def _send_event(bootstrap: str, env: dict[str, str], event: Any) -> int:
    topics = load_settings(env).topics
    topic = (
        topics.execution_created
        if isinstance(event, inputs_pb2.ExecutionCreated)
        else (topics.phase_changed if isinstance(event, inputs_pb2.PhaseChanged) else topics.session_deleted)
    )
    # The headers as a producer writes them for a valid event (``encode`` refuses to write the
    # ``ce_time`` of an out-of-range timestamp), the payload exactly as given.
    valid = type(event)()
    valid.CopyFrom(event)
    valid.meta.occurred_at.CopyFrom(new_meta().occurred_at)
    record = encode(valid)
    return await _send(bootstrap, topic, event.SerializeToString(), record.key, record.headers)


async def _outcomes_of(bootstrap: str, env: dict[str, str], execution_id: str, count: int) -> list[Any]:
    topics = load_settings(env).topics
    deadline = time.monotonic() + 60
    found: list[Any] = []
    while time.monotonic() < deadline:
        records = await read_topic(bootstrap, topics.outcomes, settle_s=0.2, timeout_s=5)
        found = [r.message for r in records if getattr(r.message, "execution_id", None) == execution_id]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.3)
    raise AssertionError(f"{execution_id}: {len(found)} of {count} outcomes after 60 s: {found}")


async def _dead_letter_at(bootstrap: str, env: dict[str, str], topic: str, offset: int) -> Received:
    dlq = load_settings(env).topics.dead_letter
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for rec in await read_topic(bootstrap, dlq, settle_s=0.2, timeout_s=5):
            if rec.headers.get("dlq_source_topic") == topic and rec.headers.get("dlq_source_offset") == str(
                offset
            ):
                return rec
        await asyncio.sleep(0.3)
    raise AssertionError(f"no dead letter for {topic}@{offset}")


async def _bad_then_ordinary(
    bootstrap: str, env: dict[str, str], bad: Any, reason: str
) -> tuple[Received, list[Any]]:
    """Write ``bad`` and then an ordinary create; the create is provisioned, ``bad`` dead-lettered."""
    topics = load_settings(env).topics
    topic = (
        topics.execution_created
        if isinstance(bad, inputs_pb2.ExecutionCreated)
        else (topics.phase_changed if isinstance(bad, inputs_pb2.PhaseChanged) else topics.session_deleted)
    )
    offset = await _send_event(bootstrap, env, bad)
    ordinary = f"wf-after-{uuid.uuid4().hex[:8]}"
    await _send_event(bootstrap, env, wf_created(ordinary))
    outcomes = await _outcomes_of(bootstrap, env, ordinary, 1)
    assert isinstance(outcomes[0], outcomes_pb2.SandboxProvisioned), outcomes
    letter = await _dead_letter_at(bootstrap, env, topic, offset)
    assert reason in letter.headers["dlq_reason"], letter.headers
    assert letter.headers["dlq_source_partition"] == "0"
    return letter, outcomes


def _wf(execution_id: str, **meta: Any) -> inputs_pb2.ExecutionCreated:
    event = wf_created(execution_id)
    for name, value in meta.items():
        setattr(event.meta.occurred_at, name, value)
    return event


@pytest.mark.timeout(240)
async def test_no_bad_record_stops_its_partition(
    pod: tuple[Composed, dict[str, str]], kafka_bootstrap: str
) -> None:
    composed, env = pod
    topics = load_settings(env).topics

    # 1. A timestamp past 9999-12-31 (its JSON form raises): refused at the edge.
    await _bad_then_ordinary(
        kafka_bootstrap, env, _wf("wf-9999", seconds=PAST_9999), "outside protobuf's Timestamp range"
    )
    # 2. nanos of 1e9: refused the same way.
    deleted = inputs_pb2.SessionDeleted(meta=new_meta(), session_id="ses-nanos")
    deleted.meta.occurred_at.nanos = 1_000_000_000
    await _bad_then_ordinary(kafka_bootstrap, env, deleted, "nanos 1000000000 is outside")

    # 3. An agent create with a 400 KB org: its state would be 1.2 MB. Refused by size, and the
    #    dead letter keeps the payload whole (it fits).
    big_org = inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr-big-org",
        session_id="ses-big-org",
        org="o" * 400_000,
        session_execution_target=common_pb2.CLOUD,
    )
    letter, _ = await _bad_then_ordinary(kafka_bootstrap, env, big_org, "bytes exceeds the 65536-byte limit")
    assert letter.value == big_org.SerializeToString()

    # 4. A workflow create with a 300 KB execution id (and key): the dead letter cuts the key to
    #    what it keeps and carries the original's size and hash.
    long_id = "x" * 300_000
    letter, _ = await _bad_then_ordinary(kafka_bootstrap, env, wf_created(long_id), "exceeds the 65536-byte")
    assert letter.key == long_id[:KEY_KEPT_BYTES]
    assert letter.headers["dlq_key_size"] == "300000"
    assert letter.headers["dlq_key_sha256"] == hashlib.sha256(long_id.encode()).hexdigest()

    # 5. A phase change from the year 9000, then the real COMPLETED: the future one is refused
    #    (it would make every real phase change stale), so the real one tears the sandbox down.
    wf = f"wf-future-{uuid.uuid4().hex[:6]}"
    await _send_event(kafka_bootstrap, env, wf_created(wf))
    await _outcomes_of(kafka_bootstrap, env, wf, 1)
    future = inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=wf,
        previous_phase=common_pb2.EXECUTION_PENDING,
        new_phase=common_pb2.EXECUTION_IN_PROGRESS,
    )
    future.meta.occurred_at.seconds = YEAR_9000
    await _bad_then_ordinary(kafka_bootstrap, env, future, "ahead of the record's timestamp")
    await _send_event(kafka_bootstrap, env, wf_terminal(wf))
    outcomes = await _outcomes_of(kafka_bootstrap, env, wf, 2)
    assert [type(o).__name__ for o in outcomes] == ["SandboxProvisioned", "SandboxDeprovisioned"]

    # 6. An input that passes the edge (a 30 KB org) but whose state record the state topic
    #    refuses (max.message.bytes 20000): its transaction fails at the broker on every retry.
    #    After SANDBOX_LANES_DEAD_LETTER_ATTEMPTS (2) attempts on its own it is dead-lettered,
    #    whole, and the create behind it goes on.
    refused = wf_created(f"wf-refused-{uuid.uuid4().hex[:6]}")
    refused.org = "r" * 30_000
    letter, _ = await _bad_then_ordinary(
        kafka_bootstrap, env, refused, "its transaction failed 2 times the same way"
    )
    assert (
        "MessageSizeTooLarge" in letter.headers["dlq_reason"]
        or "too large" in letter.headers["dlq_reason"].lower()
    )
    # What operators' tools read: the group that gave it up, the exception, the attempts.
    assert letter.headers["dlq_consumer_group"] == env["SANDBOX_LANES_GROUP_ID"]
    assert letter.headers["dlq_exception_class"] == "MessageSizeTooLargeError"
    assert letter.headers["dlq_attempts"] == "2"
    assert letter.value == refused.SerializeToString()
    assert composed.pod.health().alive

    # Nothing of the refused records reached the state topic, and the pod never fell over.
    states = await read_topic(kafka_bootstrap, topics.state, settle_s=0.2)
    assert not any(r.key in ("wf-9999", "axr-big-org", refused.execution_id) for r in states)
    assert not [r for r in states if r.key == long_id]
    await _audit(kafka_bootstrap, env)


def _produce_with_raw_header_key(
    bootstrap: str, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]], raw_key: bytes
) -> None:
    """Produce a record whose first header key is ``raw_key`` (not UTF-8).

    aiokafka's producer encodes header keys itself; its pure-Python record builder (forced by
    AIOKAFKA_NO_EXTENSIONS) calls ``str.encode`` on the key, which a ``str`` subclass answers
    with the raw bytes. Other clients write any bytes there; this one is the one at hand.
    """
    script = textwrap.dedent(
        f"""
        import asyncio
        from aiokafka import AIOKafkaProducer

        class RawKey(str):
            def encode(self, *args, **kwargs):
                return {raw_key!r}

        async def main():
            producer = AIOKafkaProducer(bootstrap_servers={bootstrap!r}, acks="all")
            await producer.start()
            try:
                headers = [(RawKey("raw"), b"v"), *{headers!r}]
                await producer.send_and_wait({topic!r}, {value!r}, key={key!r}, headers=headers)
            finally:
                await producer.stop()

        asyncio.run(main())
        """
    )
    env = {**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)


@pytest.mark.timeout(180)
async def test_a_record_the_client_cannot_parse_is_dead_lettered_by_offset(
    pod: tuple[Composed, dict[str, str]], kafka_bootstrap: str
) -> None:
    composed, env = pod
    topics = load_settings(env).topics
    before = f"wf-before-{uuid.uuid4().hex[:6]}"
    after = f"wf-after-{uuid.uuid4().hex[:6]}"
    await _send_event(kafka_bootstrap, env, wf_created(before))
    bad = encode(wf_created(f"wf-unparsable-{uuid.uuid4().hex[:6]}"))
    await asyncio.to_thread(
        _produce_with_raw_header_key,
        kafka_bootstrap,
        topics.execution_created,
        bad.key,
        bad.value,
        bad.headers,
        b"\xff\xfe-not-utf8",
    )
    await _send_event(kafka_bootstrap, env, wf_created(after))
    for execution_id in (before, after):
        outcomes = await _outcomes_of(kafka_bootstrap, env, execution_id, 1)
        assert isinstance(outcomes[0], outcomes_pb2.SandboxProvisioned)
    # The bad record sits between the two creates: offset 1 of the one partition.
    letter = await _dead_letter_at(kafka_bootstrap, env, topics.execution_created, 1)
    assert letter.headers["dlq_unparsable"] == "true"
    assert "UnicodeDecodeError" in letter.headers["dlq_reason"]
    assert composed.pod.metrics.unparsable._value.get() >= 1
    # The committed offset moved past it: a restarted pod would not meet it again.
    consumer_offsets = await _committed(kafka_bootstrap, env, TopicPartition(topics.execution_created, 0))
    assert consumer_offsets == 3
    await _audit(kafka_bootstrap, env)


async def _audit(bootstrap: str, env: dict[str, str]) -> None:
    """The audit replay re-derives every decision and dead letter, the runtime's own included."""
    settings = load_settings(env)
    report = await replay(
        bootstrap,
        settings.topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        max_clock_ahead_s=settings.max_clock_ahead_s,
    )
    assert report.divergences == [], [d.as_dict() for d in report.divergences]
    assert report.matched_dead_letters == report.recorded_dead_letters > 0


async def _committed(bootstrap: str, env: dict[str, str], tp: TopicPartition) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(env["SANDBOX_LANES_GROUP_ID"])
        return int(offsets[tp].offset)
    finally:
        await admin.close()


@pytest.mark.timeout(180)
async def test_a_finished_execution_is_tombstoned_after_retention(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = _one_partition_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_STATE_RETENTION_S="3")
    topics = load_settings(env).topics
    done, running = f"wf-done-{uuid.uuid4().hex[:6]}", f"wf-running-{uuid.uuid4().hex[:6]}"
    async with running_pod(env) as composed:
        for execution_id in (done, running):
            await _send_event(kafka_bootstrap, env, wf_created(execution_id))
        await _send_event(kafka_bootstrap, env, wf_terminal(done))
        await _outcomes_of(kafka_bootstrap, env, done, 2)
        await _outcomes_of(kafka_bootstrap, env, running, 1)
        # The finished one's state goes once 3 s have passed since its last input; the running
        # one's stays whatever its age.
        deadline = time.monotonic() + 30
        while composed.pod.states.get(0, done) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert composed.pod.states.get(0, done) is None
        assert composed.pod.states.get(0, running) is not None
        assert composed.pod.metrics.states_removed._value.get() == 1

        # The topic holds the tombstone (a null value) after the finished state.
        raw = [
            rec
            async for _, recs in read_to_end(kafka_bootstrap, [TopicPartition(topics.state, 0)])
            for rec in recs
        ]
        last = {rec.key.decode(): rec.value for rec in raw}
        assert last[done] is None
        assert last[running] is not None and state_pb2.ExecutionState.FromString(last[running]).created

        # After retention the same create is a new execution: provisioned again.
        again = wf_created(done)
        await _send_event(kafka_bootstrap, env, again)
        outcomes = await _outcomes_of(kafka_bootstrap, env, done, 3)
        assert [type(o).__name__ for o in outcomes] == [
            "SandboxProvisioned",
            "SandboxDeprovisioned",
            "SandboxProvisioned",
        ]

    # A restarted pod restores without the removed key (the tombstone drops it).
    async with running_pod(env) as composed:
        assert composed.pod.states.get(0, running) is not None
        restored = composed.pod.states.get(0, done)
        assert restored is not None and restored.applied_count == 1  # the new execution's alone


@pytest.mark.timeout(180)
async def test_a_dead_letter_the_dead_letter_topic_refuses_goes_bare(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A dead-letter topic with a smaller size limit than the copy: the dead letter still gets through,
    with the original's sizes and hashes instead of its bytes, and the partition goes on."""
    env = _one_partition_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_DEAD_LETTER_ATTEMPTS="2")
    topics = load_settings(env).topics
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(topics.dead_letter, 1, 1, topic_configs={"max.message.bytes": "4000"})]
        )
    finally:
        await admin.close()
    garbage = b"\xff" * 20_000  # does not decode: dead-lettered at the edge, its copy too large
    async with running_pod(env):
        offset = await _send(
            kafka_bootstrap,
            topics.execution_created,
            garbage,
            b"wf-garbage",
            [("ce_type", b"sandbox_lanes.v1.ExecutionCreated")],
        )
        ordinary = f"wf-after-{uuid.uuid4().hex[:8]}"
        await _send_event(kafka_bootstrap, env, wf_created(ordinary))
        outcomes = await _outcomes_of(kafka_bootstrap, env, ordinary, 1)
        assert isinstance(outcomes[0], outcomes_pb2.SandboxProvisioned)
        letter = await _dead_letter_at(kafka_bootstrap, env, topics.execution_created, offset)
    assert letter.headers["dlq_reason"].startswith("its transaction failed 2 times the same way")
    assert letter.value == b"" and letter.key == ""
    assert letter.headers["dlq_value_size"] == "20000"
    assert letter.headers["dlq_value_sha256"] == hashlib.sha256(garbage).hexdigest()
    assert letter.headers["dlq_key_sha256"] == hashlib.sha256(b"wf-garbage").hexdigest()
    assert letter.headers["dlq_headers_omitted"] == "1"
