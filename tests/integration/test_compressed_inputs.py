"""Every codec a Kafka producer may use, written by producers that are not Python, on every read path.

Kafka's own Java producer (4.4.0) and librdkafka (the C client) each write workflow creates with
``compression.type`` gzip, snappy, lz4 and zstd, then a terminal phase change for some of them the
same way; an agent's session is deleted on a topic whose own ``compression.type`` is zstd (the
broker recompresses what it is given). The broker's log segments are read to show each codec was
stored as such. Then, on the real broker:

* the pod (its aiokafka group consumer) provisions and tears down every execution: nothing is
  dead-lettered and no fetch was unparsable;
* ``sandbox-lanes replay`` re-derives every decision with no divergence;
* ``tail`` decodes every input;
* the pod's final states, written into a fresh deployment's state topic by the same two producers
  in every codec, are restored whole by a new pod, and read whole by the reaper's read of state.

Before aiokafka had its codec extras, snappy, lz4 and zstd inputs were dead-lettered (issue 33).

A batch the client truly cannot read (its CRC fails: damaged on the broker's disk after the broker
checked it) stays a dead letter, found by its offset, and the records after it go on.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from harness.kafka_broker import KafkaBroker

from consumers.ops.reaper import read_all_states
from consumers.ops.settings import load_settings
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.tools.replay.command import lane_config
from consumers.tools.replay.derive import replay
from consumers.tools.topic_io import tail
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2
from tests.support.foreign_producers import (
    RawRecord,
    corrupt_batch,
    event_records,
    java_produce,
    librdkafka_produce,
    stored_codecs,
)
from tests.support.pod_harness import (
    create_inputs,
    produce,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
    wf_terminal,
)

pytestmark = pytest.mark.kafka
RUN = uuid.uuid4().hex[:6]
CODECS = ("gzip", "snappy", "lz4", "zstd")
PRODUCERS = ("java", "librdkafka")
#: Creates per producer and codec: several records share a compressed batch.
PER_BATCH = 3


def _env(bootstrap: str, tmp_path: Path) -> dict[str, str]:
    """A pod that owns everything: one partition per topic, the memory driver."""
    return unique_env(bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1")


def _send(bootstrap: str, producer: str, records: list[RawRecord]) -> list[tuple[int, int]]:
    return java_produce(bootstrap, records) if producer == "java" else librdkafka_produce(bootstrap, records)


def _agent_created(execution_id: str, session_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id=session_id,
        session_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_codecs",
    )


async def _create_topic(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    """One partition, as the pod's (``SANDBOX_LANES_PARTITIONS=1``), with the topic's own ``configs``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
    finally:
        await admin.close()


async def _outcomes(bootstrap: str, topic: str, want: dict[str, list[str]]) -> dict[str, list[str]]:
    """Outcome types by record key, once every key in ``want`` has at least its expected count."""
    got: dict[str, list[str]] = {}
    for _ in range(60):
        got = {}
        for rec in await read_topic(bootstrap, topic, settle_s=0.3, timeout_s=5):
            got.setdefault(rec.key, []).append(type(rec.message).__name__)
        if all(len(got.get(key, [])) >= len(types) for key, types in want.items()):
            return got
        await asyncio.sleep(0.5)
    missing = {k: (v, got.get(k)) for k, v in want.items() if len(got.get(k, [])) < len(v)}
    raise AssertionError(f"outcomes missing after the pod had its time: {missing}")


async def _latest_states(bootstrap: str, topic: str) -> dict[str, RawRecord]:
    latest: dict[str, RawRecord] = {}
    async for _, recs in read_to_end(bootstrap, [TopicPartition(topic, 0)]):
        for rec in recs:
            assert rec.key is not None
            key = rec.key.decode()
            if rec.value is None:
                latest.pop(key, None)
            else:
                latest[key] = RawRecord("", topic, rec.key, rec.value, tuple(rec.headers))
    return latest


@pytest.mark.timeout(300)
async def test_every_codec_from_java_and_librdkafka_is_read_on_every_path(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    assert kafka_broker.work_dir is not None
    log_dir = kafka_broker.work_dir / "data"
    env = _env(bootstrap, tmp_path / "a")
    settings = load_settings(env)
    topics = settings.topics
    # A topic whose own compression.type is zstd (the others are created as the pod expects).
    await _create_topic(bootstrap, topics.session_deleted, {"compression.type": "zstd"})
    await create_inputs(env)

    groups = {
        (producer, codec): [f"wf-{producer}-{codec}-{i}-{RUN}" for i in range(PER_BATCH)]
        for producer in PRODUCERS
        for codec in CODECS
    }
    agent, session = f"axr-codecs-{RUN}", f"ses-codecs-{RUN}"
    creates = {
        producer: [
            rec
            for codec in CODECS
            for rec in event_records(codec, topics, map(wf_created, groups[(producer, codec)]))
        ]
        for producer in PRODUCERS
    }
    creates["librdkafka"] += event_records("lz4", topics, [_agent_created(agent, session)])
    terminals = {
        producer: [
            rec
            for codec in CODECS
            for rec in event_records(codec, topics, [wf_terminal(groups[(producer, codec)][0])])
        ]
        for producer in PRODUCERS
    }
    inputs = sum(map(len, creates.values())) + sum(map(len, terminals.values())) + 1

    async with running_pod(env) as composed:
        for producer in PRODUCERS:
            await asyncio.to_thread(_send, bootstrap, producer, creates[producer])
        provisioned = {key: ["SandboxProvisioned"] for ids in groups.values() for key in ids}
        await _outcomes(bootstrap, topics.outcomes, {**provisioned, agent: ["SandboxProvisioned"]})
        for producer in PRODUCERS:
            await asyncio.to_thread(_send, bootstrap, producer, terminals[producer])
        # The session's delete from a Python producer, uncompressed: its topic stores it as zstd.
        await produce(bootstrap, env, inputs_pb2.SessionDeleted(meta=new_meta(), session_id=session))
        both = ["SandboxProvisioned", "SandboxDeprovisioned"]
        # The session sandbox's outcomes: provisioned under the agent execution, torn down under
        # the session (its teardown has no execution).
        want = {
            **provisioned,
            **{ids[0]: both for ids in groups.values()},
            agent: ["SandboxProvisioned"],
            session: ["SandboxDeprovisioned"],
        }
        outcomes = await _outcomes(bootstrap, topics.outcomes, want)
        assert {key: sorted(types) for key, types in outcomes.items()} == {
            key: sorted(types) for key, types in want.items()
        }
        # Every input has its outcome, so every dead letter before them is committed too: none.
        dead = await read_topic(bootstrap, topics.dead_letter, settle_s=0.3, timeout_s=5)
        assert [(r.headers.get("dlq_reason"), r.headers.get("dlq_source_topic")) for r in dead] == []
        assert composed.pod.metrics.unparsable._value.get() == 0

    # The broker kept each producer's codec (and recompressed the zstd topic's input).
    stored = Counter(stored_codecs(log_dir, topics.execution_created, 0))
    assert set(stored) == set(CODECS) and min(stored.values()) >= len(PRODUCERS), stored
    assert set(stored_codecs(log_dir, topics.phase_changed, 0)) == set(CODECS)
    assert stored_codecs(log_dir, topics.session_deleted, 0) == ["zstd"]

    # Replay reads the compressed inputs and re-derives every decision.
    report = await replay(
        bootstrap,
        topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        max_clock_ahead_s=settings.max_clock_ahead_s,
    )
    assert report.divergences == [], [d.as_dict() for d in report.divergences]
    assert report.inputs == inputs and report.decisions == inputs
    assert report.matched_outcomes == report.recorded_outcomes == sum(map(len, want.values()))
    assert report.states_matched == report.states_compared == len(provisioned) + 2

    # tail decodes every compressed input.
    out = io.StringIO()
    printed = await tail(bootstrap, list(topics.inputs), out=out, idle_timeout_s=3.0)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert printed == len(lines) == inputs
    assert [line for line in lines if "event" not in line or "error" in line] == []

    # Restore: the pod's final states, written by the two producers in every codec into a fresh
    # deployment's state topic, are what a new pod restores, and what the reaper reads.
    final = await _latest_states(bootstrap, topics.state)
    assert len(final) == len(provisioned) + 2
    env_b = _env(bootstrap, tmp_path / "b")
    state_b = load_settings(env_b).topics.state
    await _create_topic(bootstrap, state_b, {"cleanup.policy": "compact"})
    combos = [(producer, codec) for producer in PRODUCERS for codec in CODECS]
    copies: dict[str, list[RawRecord]] = {producer: [] for producer in PRODUCERS}
    for index, (_, rec) in enumerate(sorted(final.items())):
        producer, codec = combos[index % len(combos)]
        copies[producer].append(RawRecord(codec, state_b, rec.key, rec.value, rec.headers))
    for producer in PRODUCERS:
        await asyncio.to_thread(_send, bootstrap, producer, copies[producer])
    stored = Counter(stored_codecs(log_dir, state_b, 0))
    assert set(stored) == set(CODECS) and min(stored.values()) >= len(PRODUCERS), stored

    expected = {key: state_pb2.ExecutionState.FromString(rec.value or b"") for key, rec in final.items()}
    async with running_pod(env_b) as restored:
        assert {key: restored.pod.states.get(0, key) for key in expected} == expected
        assert restored.pod.metrics.restored_keys._value.get() == len(expected)
    assert await read_all_states(bootstrap, state_b) == expected


@pytest.mark.timeout(180)
async def test_a_batch_whose_crc_fails_is_dead_lettered_and_the_partition_goes_on(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    assert kafka_broker.work_dir is not None
    env = _env(bootstrap, tmp_path)
    settings = load_settings(env)
    topics = settings.topics
    await create_inputs(env)
    before, bad, after = (f"wf-crc-{name}-{RUN}" for name in ("before", "bad", "after"))
    offsets = []
    for execution_id in (before, bad, after):  # one lz4 batch each
        records = event_records("lz4", topics, [wf_created(execution_id)])
        offsets += await asyncio.to_thread(librdkafka_produce, bootstrap, records)
    assert offsets == [(0, 0), (0, 1), (0, 2)]
    damaged = corrupt_batch(kafka_broker.work_dir / "data", topics.execution_created, 0, 1)
    assert damaged.codec == "lz4"

    async with running_pod(env) as composed:
        got = await _outcomes(
            bootstrap, topics.outcomes, {before: ["SandboxProvisioned"], after: ["SandboxProvisioned"]}
        )
        assert bad not in got
        (letter,) = await read_topic(bootstrap, topics.dead_letter, at_least=1, timeout_s=30)
        assert composed.pod.metrics.unparsable._value.get() >= 1
    assert letter.headers["dlq_unparsable"] == "true"
    assert letter.headers["dlq_source_topic"] == topics.execution_created
    assert letter.headers["dlq_source_offset"] == "1"
    assert "CorruptRecordException" in letter.headers["dlq_reason"], letter.headers
    # aiokafka hands out no bytes of a batch it refused (docs/guarantees.md): the letter has none.
    assert not letter.key and not letter.value

    # Replay meets the same batch and counts the runtime's dead letter as matched.
    report = await replay(
        bootstrap,
        topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        max_clock_ahead_s=settings.max_clock_ahead_s,
    )
    assert report.divergences == [], [d.as_dict() for d in report.divergences]
    assert report.matched_dead_letters == report.recorded_dead_letters == 1
