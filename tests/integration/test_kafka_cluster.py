"""The harness's three-node KRaft cluster (devtools/harness/kafka_broker.py ``KafkaCluster``): it starts
with the replication settings the broker-fault tests rely on, names the group and transaction
coordinators as the brokers place them, and a node killed with SIGKILL and started again rejoins every
ISR (checked by the harness's metadata read and by Kafka's own TopicCommand)."""

from __future__ import annotations

import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from harness.kafka_broker import KafkaCluster, cluster_metadata, coordinator_partition

pytestmark = pytest.mark.kafka


async def _create_topic(cluster: KafkaCluster, partitions: int = 3) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    # Replication -1 (the broker's default.replication.factor), as the pod creates its topics; aiokafka's
    # NewTopic refuses -1 on the client side, the broker takes it (KIP-464).
    topic: NewTopic = NewTopic.__new__(NewTopic)
    topic.name, topic.num_partitions, topic.replication_factor = name, partitions, -1
    topic.replica_assignments, topic.topic_configs = {}, {}
    try:
        await admin.create_topics([topic])
    finally:
        await admin.close()
    return name


def _metadata(
    cluster: KafkaCluster, topic: str | None = None
) -> tuple[set[int], dict[tuple[str, int], tuple[int, ...]]]:
    """Brokers and replica sets as a live node reports them (once it knows ``topic``: a new topic
    reaches each node's metadata a moment after its creation)."""
    node = next(n for n in cluster.nodes if n.running)
    deadline = time.monotonic() + 15
    while True:
        brokers, parts = cluster_metadata("127.0.0.1", node.port)
        replicas = {(p.topic, p.partition): p.replicas for p in parts}
        if topic is None or any(t == topic for t, _ in replicas) or time.monotonic() > deadline:
            return brokers, replicas
        time.sleep(0.1)


def _leaders(cluster: KafkaCluster, topic: str) -> dict[int, int]:
    node = next(n for n in cluster.nodes if n.running)
    deadline = time.monotonic() + 15
    while True:
        _, parts = cluster_metadata("127.0.0.1", node.port)
        leaders = {p.partition: p.leader for p in parts if p.topic == topic}
        if leaders or time.monotonic() > deadline:
            return leaders
        time.sleep(0.1)


async def test_cluster_has_three_brokers_replication_three_and_min_isr_two(
    kafka_cluster: KafkaCluster,
) -> None:
    brokers, _ = _metadata(kafka_cluster)
    assert brokers == {1, 2, 3}
    topic = await _create_topic(kafka_cluster)
    _, replicas = _metadata(kafka_cluster, topic)
    assert {len(r) for (t, _), r in replicas.items() if t == topic} == {3}, replicas
    for internal in ("__consumer_offsets", "__transaction_state"):
        sizes = {len(r) for (t, _), r in replicas.items() if t == internal}
        assert sizes == {3}, (internal, sizes)

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_cluster.bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, "2")])
    finally:
        await admin.close()
    [resource] = response.resources
    configs = {entry[0]: entry[1] for entry in resource[4]}
    assert {
        name: configs[name]
        for name in (
            "default.replication.factor",
            "min.insync.replicas",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
            "transaction.state.log.min.isr",
        )
    } == {
        "default.replication.factor": "3",
        "min.insync.replicas": "2",
        "offsets.topic.replication.factor": "3",
        "transaction.state.log.replication.factor": "3",
        "transaction.state.log.min.isr": "2",
    }
    assert kafka_cluster.under_replicated() == []
    assert kafka_cluster.under_replicated_by_tool() == []


def test_coordinators_are_the_leaders_of_the_keys_internal_partitions(kafka_cluster: KafkaCluster) -> None:
    """FindCoordinator's answer, checked against Kafka's placement rule (the leader of partition
    abs(hashCode) % n of the internal topic), computed here independently of the broker's answer."""
    node = next(n for n in kafka_cluster.nodes if n.running)
    _, parts = cluster_metadata("127.0.0.1", node.port)
    leader = {(p.topic, p.partition): p.leader for p in parts}
    n = kafka_cluster.internal_partitions
    seen: set[int] = set()
    for i in range(12):
        group, txn = f"group-{i}-{uuid.uuid4().hex[:6]}", f"txn-{i}-{uuid.uuid4().hex[:6]}"
        g = kafka_cluster.group_coordinator(group)
        t = kafka_cluster.transaction_coordinator(txn)
        assert (
            kafka_cluster.nodes[g].node_id == leader[("__consumer_offsets", coordinator_partition(group, n))]
        )
        assert (
            kafka_cluster.nodes[t].node_id == leader[("__transaction_state", coordinator_partition(txn, n))]
        )
        seen |= {g, t}
    assert len(seen) > 1, "every coordinator on one node: the placement check proves little"


async def test_a_killed_node_restarted_rejoins_every_isr(kafka_cluster: KafkaCluster) -> None:
    topic = await _create_topic(kafka_cluster, partitions=1)
    victim = kafka_cluster.index_of(_leaders(kafka_cluster, topic)[0])
    group = f"g-{topic}"
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_cluster.bootstrap,
        acks="all",
        enable_idempotence=True,
        request_timeout_ms=30000,
    )
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"before", key=b"k")
        kafka_cluster.kill(victim)
        kafka_cluster.wait_fenced(victim)
        # The node is down: its replicas are out of every ISR, which both checks must see.
        short = kafka_cluster.under_replicated()
        assert any(p.topic == topic for p in short), short
        assert any(kafka_cluster.nodes[victim].node_id not in p.isr for p in short)
        tool_lines = kafka_cluster.under_replicated_by_tool()
        assert any(topic in line for line in tool_lines), tool_lines
        # min.insync.replicas=2 of 3: acks=all writes go on with one node down.
        await producer.send_and_wait(topic, b"while-down", key=b"k")
        assert _leaders(kafka_cluster, topic)[0] != kafka_cluster.nodes[victim].node_id
        kafka_cluster.start_node(victim)
        kafka_cluster.wait_isr_full(120)
        assert kafka_cluster.under_replicated() == []
        assert kafka_cluster.under_replicated_by_tool() == []
        await producer.send_and_wait(topic, b"after", key=b"k")
    finally:
        await producer.stop()
    # Every record written with acks=all is there, and a group commits its offsets on the cluster.
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_cluster.bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    try:
        got: list[bytes] = []
        while len(got) < 3:
            batch = await consumer.getmany(timeout_ms=10_000)
            assert batch, f"timed out after {got}"
            got += [r.value for recs in batch.values() for r in recs if r.value is not None]
        await consumer.commit()
        committed = await consumer.committed(TopicPartition(topic, 0))
    finally:
        await consumer.stop()
    assert got == [b"before", b"while-down", b"after"]
    assert committed == 3
