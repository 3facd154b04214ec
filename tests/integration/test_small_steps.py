"""Small steps cost what the bad record costs, not what stands before it (issue 42, finding 9).

On the real broker: a batch of good creates with one in the middle whose state the state topic
refuses (its ``max.message.bytes``): the batch fails once, then the partition goes one record per
transaction until the whole failed batch is behind it, and the bad record is dead-lettered after
``SANDBOX_LANES_DEAD_LETTER_ATTEMPTS`` failures of its own. Before, the first good step ended the
small steps, so a bad record at position k cost about k failures of the whole batch (and, with
exactly_once, k producer renewals).
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from harness.memory_driver import MemoryProvisioner

from consumers.ops.settings import load_settings
from consumers.tools.topics import create_input_topics
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.support.pod_harness import produce, read_topic, running_pod, unique_env, wf_created

pytestmark = [pytest.mark.kafka]

#: Good creates before the bad one, and after it.
BEFORE, AFTER = 12, 4
ATTEMPTS = 2


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
async def test_a_bad_record_behind_k_good_ones_costs_one_batch_failure_and_its_own(
    kafka_bootstrap: str, tmp_path: Path, guarantee: str
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PARTITIONS="1",
        SANDBOX_LANES_PROCESSING_GUARANTEE=guarantee,
        SANDBOX_LANES_DEAD_LETTER_ATTEMPTS=str(ATTEMPTS),
        SANDBOX_LANES_MAX_BATCH="100",
    )
    settings = load_settings(env)
    topics = settings.topics
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    topics.state,
                    1,
                    1,
                    topic_configs={"cleanup.policy": "compact", "max.message.bytes": "20000"},
                )
            ]
        )
    finally:
        await admin.close()
    await create_input_topics(settings)
    tag = uuid.uuid4().hex[:6]
    good = [wf_created(f"wf-step-{tag}-{i}") for i in range(BEFORE + AFTER)]
    bad = wf_created(f"wf-step-{tag}-bad")
    bad.org = "o" * 30_000  # passes the edge; its state record is over the state topic's limit
    # All written before the pod starts: its first fetch holds the whole batch.
    await produce(kafka_bootstrap, env, *good[:BEFORE], bad, *good[BEFORE:])
    async with running_pod(env, provisioner=MemoryProvisioner()) as composed:
        outcomes = await read_topic(
            kafka_bootstrap, topics.outcomes, at_least=len(good), timeout_s=90, settle_s=0.5
        )
        letters = await read_topic(
            kafka_bootstrap, topics.dead_letter, at_least=1, timeout_s=30, settle_s=0.0
        )
        failures = composed.pod.stats.commit_failures
    provisioned = Counter(
        r.message.execution_id for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxProvisioned)
    )
    assert provisioned == Counter(e.execution_id for e in good)
    assert [r.key for r in letters] == [bad.execution_id]
    # One failure of the batch, then the bad record's own ATTEMPTS; nothing for the k good ones.
    print(f"{guarantee}: {failures} failed transactions for a bad record behind {BEFORE} good ones")
    assert failures == 1 + ATTEMPTS, failures
