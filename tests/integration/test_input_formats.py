"""Every way issue 43 measured a producer writing an input event, written by a real client of that
style, provisioned and torn down by one pod on the real broker, and re-derived by replay and tail.

One workflow execution per style (create, IN_PROGRESS, COMPLETED):

* CloudEvents binary headers + protobuf: this project's ``encode`` (aiokafka);
* protobuf bytes, no headers: Kafka's Java producer (the topic says the type);
* the Schema Registry framing: confluent-kafka's own ``ProtobufSerializer`` (its in-process
  registry), written by librdkafka; ExecutionCreated is its file's first message (the one-byte
  index), PhaseChanged its second (the full zigzag path);
* the same framing plus CloudEvents headers: Kafka's Java producer;
* protobuf JSON: Node 20, ``@bufbuild/protobuf``'s ``toJson``, kafkajs;
* CloudEvents structured mode (``data_base64``): Node 20, the CloudEvents SDK's Kafka binding, kafkajs.

Before issue 43 every style but the first was dead-lettered, 3 of 3 records each.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf.message import Message
from harness.kafka_broker import KafkaBroker

from consumers.ops.settings import load_settings
from consumers.runtime.kafka.topology import Topics
from consumers.tools.replay.command import lane_config
from consumers.tools.replay.derive import replay
from consumers.tools.topic_io import tail, topic_for
from events import schema_registry
from events.codec import encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.foreign_producers import RawRecord, java_produce, librdkafka_produce
from tests.support.node_producers import NodeRecord, node_produce
from tests.support.pod_harness import create_inputs, produce, read_topic, running_pod, unique_env

pytestmark = pytest.mark.kafka
RUN = uuid.uuid4().hex[:6]
STYLES = ("ce-binary", "bare", "sr-framing", "sr-framing-ce", "json", "structured")


def _events(execution_id: str) -> list[Message]:
    def phase(previous: int, new: int) -> inputs_pb2.PhaseChanged:
        return inputs_pb2.PhaseChanged(
            meta=new_meta(),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id=execution_id,
            previous_phase=previous,  # type: ignore[arg-type]
            new_phase=new,  # type: ignore[arg-type]
        )

    created = inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_formats",
    )
    return [
        created,
        phase(common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS),
        phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED),
    ]


class _Framing:
    """confluent-kafka's ProtobufSerializer, one per message type, sharing its in-process registry."""

    def __init__(self) -> None:
        self.client = SchemaRegistryClient.new_client({"url": f"mock://formats-{RUN}"})
        self.serializers: dict[type[Message], ProtobufSerializer] = {}

    def __call__(self, event: Message, topic: str) -> bytes:
        cls = type(event)
        serializer = self.serializers.get(cls)
        if serializer is None:
            serializer = self.serializers[cls] = ProtobufSerializer(
                cls, self.client, {"use.deprecated.format": False}
            )
        value = serializer(event, SerializationContext(topic, MessageField.VALUE))
        assert value is not None
        return bytes(value)


def _write(bootstrap: str, env: dict[str, str], topics: Topics, step: list[tuple[str, Message]]) -> None:
    """Write one step's events, each in its style, by its style's client."""
    framing = _Framing()
    java: list[RawRecord] = []
    librdkafka: list[RawRecord] = []
    node: list[NodeRecord] = []
    ours: list[Message] = []
    for style, event in step:
        topic = topic_for(event, topics)
        record = encode(event, source=f"producer-{style}")
        if style == "ce-binary":
            ours.append(event)
        elif style == "bare":
            java.append(RawRecord("none", topic, record.key, event.SerializeToString()))
        elif style == "sr-framing":
            librdkafka.append(RawRecord("none", topic, record.key, framing(event, topic)))
        elif style == "sr-framing-ce":
            java.append(RawRecord("none", topic, record.key, framing(event, topic), tuple(record.headers)))
        else:
            node.append(NodeRecord(style, topic, record.key.decode(), event))
    for event in ours:
        asyncio.run(produce(bootstrap, env, event))
    java_produce(bootstrap, java)
    librdkafka_produce(bootstrap, librdkafka)
    assert node_produce(bootstrap, node) == len(node)


async def _outcomes(bootstrap: str, topic: str, keys: list[str], want: int) -> dict[str, list[str]]:
    got: dict[str, list[str]] = {}
    for _ in range(60):
        got = {}
        for rec in await read_topic(bootstrap, topic, settle_s=0.3, timeout_s=5):
            got.setdefault(rec.key, []).append(type(rec.message).__name__)
        if all(len(got.get(key, [])) >= want for key in keys):
            return got
        await asyncio.sleep(0.5)
    return got


@pytest.mark.timeout(300)
async def test_every_producer_style_is_provisioned_and_torn_down(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    env = unique_env(bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1")
    settings = load_settings(env)
    topics = settings.topics
    await create_inputs(env)
    ids = {style: f"wf-{style}-{RUN}" for style in STYLES}
    events = {style: _events(ids[style]) for style in STYLES}

    async with running_pod(env) as composed:
        await asyncio.to_thread(_write, bootstrap, env, topics, [(s, events[s][0]) for s in STYLES])
        await _outcomes(bootstrap, topics.outcomes, list(ids.values()), 1)
        for index in (1, 2):
            await asyncio.to_thread(_write, bootstrap, env, topics, [(s, events[s][index]) for s in STYLES])
        outcomes = await _outcomes(bootstrap, topics.outcomes, list(ids.values()), 2)
        dead = await read_topic(bootstrap, topics.dead_letter, settle_s=0.3, timeout_s=3)
        dead_by_style = {
            style: [r.headers.get("dlq_reason") for r in dead if r.headers.get("dlq_source_key") == key]
            for style, key in ids.items()
        }
        stats = composed.pod.stats
    figures = {
        style: {"outcomes": sorted(outcomes.get(key, [])), "dead_lettered": len(dead_by_style[style])}
        for style, key in ids.items()
    }
    print("\nissue 43 figures, per style:", json.dumps(figures, indent=1))
    assert [(r.headers.get("dlq_reason"), r.key) for r in dead] == []
    assert figures == {
        style: {"outcomes": ["SandboxDeprovisioned", "SandboxProvisioned"], "dead_lettered": 0}
        for style in STYLES
    }
    assert stats.dead_lettered == 0

    # One decode path: replay re-derives every decision, tail decodes every input.
    report = await replay(
        bootstrap,
        topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        max_clock_ahead_s=settings.max_clock_ahead_s,
    )
    assert report.divergences == [], [d.as_dict() for d in report.divergences]
    assert report.inputs == report.decisions == 3 * len(STYLES)
    out = io.StringIO()
    printed = await tail(bootstrap, list(topics.inputs), out=out, idle_timeout_s=3.0, topics=topics)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert printed == len(lines) == 3 * len(STYLES)
    assert [line for line in lines if "event" not in line or "error" in line] == []


@pytest.mark.timeout(180)
async def test_a_registry_outage_is_waited_out_never_a_dead_letter(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """With SANDBOX_LANES_SCHEMA_REGISTRY_URL set and the registry not answering, a framed create's
    partition rests and tries again (the world's fault); once the registry answers, it is provisioned
    once. The registry's answers come from confluent-kafka's in-process registry (no registry server
    runs here); the pod, the broker and the serializer are real."""
    bootstrap = kafka_broker.bootstrap
    env = unique_env(bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1")
    topics = load_settings(env).topics
    await create_inputs(env)
    framing = _Framing()
    execution = f"wf-outage-{RUN}"
    created = _events(execution)[0]
    value = framing(created, topics.execution_created)
    registry = schema_registry.configure("http://127.0.0.1:1")  # nothing listens on port 1
    assert registry is not None
    try:
        async with running_pod(env) as composed:
            await asyncio.to_thread(
                librdkafka_produce,
                bootstrap,
                [RawRecord("none", topics.execution_created, execution.encode(), value)],
            )
            stats = composed.pod.stats
            deadline = asyncio.get_running_loop().time() + 60
            while stats.commit_failures < 2:  # the record's partition failed, rested, failed again
                assert asyncio.get_running_loop().time() < deadline, "the pod never tried the record"
                await asyncio.sleep(0.1)
            assert stats.dead_lettered == 0
            registry._fetch = _registry_answers(framing)  # the registry answers from now on
            got = await _outcomes(bootstrap, topics.outcomes, [execution], 1)
            failures = stats.commit_failures
            dead = await read_topic(bootstrap, topics.dead_letter, settle_s=0.3, timeout_s=3)
        print(
            f"\nregistry outage: {failures} failed tries of the partition, then provisioned; 0 dead letters"
        )
        assert got.get(execution) == ["SandboxProvisioned"]
        assert dead == [] and stats.dead_lettered == 0
    finally:
        schema_registry.configure("")


def _registry_answers(framing: _Framing) -> schema_registry.Fetch:
    def fetch(method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        schema = framing.client.get_schema(int(url.rsplit("/", 1)[1]))
        return 200, json.dumps({"schemaType": schema.schema_type, "schema": schema.schema_str}).encode()

    return fetch
