"""Topic defaults on the real broker: the pod never creates its inputs; ``sandbox-lanes topics --apply``
creates the plan with the broker's replication factor (-1), the state topic compacted with its
tombstone and compaction settings, the dead-letter topic with its long retention."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from harness.memory_driver import MemoryProvisioner

from consumers.ops.compose import compose
from consumers.ops.settings import load_settings
from consumers.runtime.kafka.topology import (
    DEAD_LETTER_RETENTION_MS,
    TOMBSTONE_RETENTION_MS,
    MissingTopicsError,
    create_missing,
    plan_topics,
)
from tests.support.pod_harness import ROOT, running_pod, unique_env

pytestmark = pytest.mark.kafka


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "STIGMER_", "KAFKA_"))}
    return subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", *argv],
        env={**base, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
    )


async def _described(bootstrap: str, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """name -> {"partitions", "replicas", "configs"} of the topics that exist."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found = {
            t["topic"]: t
            for t in await admin.describe_topics(list(names))
            if t["error_code"] == 0 and t["partitions"]
        }
        out: dict[str, dict[str, Any]] = {}
        for name, topic in found.items():
            (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
            (resource,) = response.resources
            out[name] = {
                "partitions": len(topic["partitions"]),
                "replicas": {len(p["replicas"]) for p in topic["partitions"]},
                "configs": {entry[0]: entry[1] for entry in resource[4]},
            }
        return out
    finally:
        await admin.close()


async def test_the_pod_never_creates_its_inputs_and_names_the_missing_ones(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_HTTP_PORT="0")
    topics = load_settings(env).topics
    done = _cli(env, "run")
    assert done.returncode == 2, done.stderr
    *logs, line = done.stderr.splitlines()
    assert all(log.startswith("{") for log in logs), done.stderr
    assert line == (
        f"sandbox-lanes run: missing input topics: {', '.join(topics.inputs)} (the pod never creates its "
        "inputs; create them first: `sandbox-lanes topics` prints the commands, `sandbox-lanes topics "
        "--apply` runs them)"
    )
    assert await _described(kafka_bootstrap, topics.all()) == {}  # nothing created, its own topics neither


async def test_topics_apply_creates_the_plan_with_the_brokers_replication_and_the_settings(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path)  # SANDBOX_LANES_PARTITIONS=2, REPLICATION unset: -1
    topics = load_settings(env).topics
    first = _cli(env, "topics", "--apply")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"created {name}"
        for name in (*topics.inputs, topics.state, topics.outcomes, topics.dead_letter, topics.lane_config)
    ]
    again = _cli(env, "topics", "--apply")
    assert again.returncode == 0 and all(line.startswith("exists  ") for line in again.stdout.splitlines())

    described = await _described(kafka_bootstrap, topics.all())
    assert set(described) == set(topics.all())
    for topic in described.values():
        assert (topic["partitions"], topic["replicas"]) == (2, {1})  # the broker's default.replication.factor
        assert topic["configs"]["min.insync.replicas"] == "1"  # the broker's default, not set on the topic
    state = described[topics.state]["configs"]
    assert state["cleanup.policy"] == "compact"
    assert int(state["delete.retention.ms"]) == TOMBSTONE_RETENTION_MS >= 24 * 3600 * 1000
    assert int(state["min.compaction.lag.ms"]) == 3600 * 1000
    dlq = described[topics.dead_letter]["configs"]
    assert (dlq["cleanup.policy"], int(dlq["retention.ms"])) == ("delete", DEAD_LETTER_RETENTION_MS)
    assert described[topics.execution_created]["configs"]["cleanup.policy"] == "delete"
    (config,) = (await _described(kafka_bootstrap, (topics.lane_config,))).values()
    assert (config["partitions"], config["configs"]["cleanup.policy"]) == (1, "compact")


async def test_an_explicit_replication_sets_min_insync_replicas(kafka_bootstrap: str, tmp_path: Path) -> None:
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_REPLICATION="1")
    topics = load_settings(env).topics
    done = _cli(env, "topics", "--apply")
    assert done.returncode == 0, done.stderr
    described = await _described(kafka_bootstrap, (topics.state,))
    assert described[topics.state]["configs"]["min.insync.replicas"] == "1"
    too_many = _cli(
        unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_REPLICATION="3"), "topics", "--apply"
    )  # one broker: refused by the broker, in one line
    assert too_many.returncode == 2
    (line,) = too_many.stderr.splitlines()
    assert (
        line.startswith("sandbox-lanes topics: cannot create topics: ")
        and "replication factor" in line.lower()
    )


async def test_the_pod_creates_its_own_topics_with_the_inputs_partition_count(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory")  # PARTITIONS=2
    settings = load_settings(env)
    topics = settings.topics
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:  # the producing side made its inputs with 3 partitions
        await create_missing(admin, tuple(s for s in plan_topics(topics, 3) if s.role == "input"))
    finally:
        await admin.close()
    async with running_pod(env, provisioner=MemoryProvisioner()):
        pass
    described = await _described(kafka_bootstrap, topics.all())
    assert {name: t["partitions"] for name, t in described.items()} == {name: 3 for name in topics.all()}
    assert described[topics.state]["configs"]["cleanup.policy"] == "compact"


async def test_with_creation_off_the_pod_names_every_missing_topic(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_CREATE_TOPICS="false"
    )
    settings = load_settings(env)
    topics = settings.topics
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await create_missing(admin, tuple(s for s in plan_topics(topics, 2) if s.role == "input"))
    finally:
        await admin.close()
    composed = compose(settings, logging.getLogger("sandbox_lanes"), provisioner=MemoryProvisioner())
    with pytest.raises(MissingTopicsError) as err:
        await composed.pod.start()
    await composed.pod.stop()
    assert err.value.missing == [topics.state, topics.outcomes, topics.dead_letter]
    assert "SANDBOX_LANES_CREATE_TOPICS=false" in str(err.value)
    assert set(await _described(kafka_bootstrap, topics.all())) == set(topics.inputs)
