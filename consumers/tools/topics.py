"""``sandbox-lanes topics``: the topic plan as ``kafka-topics.sh`` commands or Strimzi KafkaTopic
resources, or applied (``--apply``: every missing topic created, the inputs included).

The plan is :func:`consumers.runtime.kafka.topology.plan_topics` over the configured names,
``SANDBOX_LANES_PARTITIONS`` and ``SANDBOX_LANES_REPLICATION`` (-1 = the broker's default: the
replication flag / ``replicas`` field is left out, so the broker's ``default.replication.factor``
applies). The pod itself never creates an input topic; this command is the operator's way to.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import sys
from collections.abc import Iterable

import yaml

from consumers.ops.settings import Settings, load_settings
from consumers.runtime.kafka.topology import BROKER_DEFAULT, TopicSpec, plan_topics

_ROLE_NOTE = {
    "input": "input: written by the producing side; the pod checks it exists and never creates it",
    "state": "state: compacted, co-partitioned with the inputs; the pod creates it when missing",
    "output": "outcomes: the pod creates it when missing",
    "dead-letter": "dead letters: long retention; the pod creates it when missing",
    "config": (
        "lane configuration records (replay reads them): compacted, one partition;"
        " the pod creates it when missing"
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("kafka-topics", "strimzi"),
        default="kafka-topics",
        help="kafka-topics.sh commands (default) or Strimzi KafkaTopic resources (YAML)",
    )
    parser.add_argument("--apply", action="store_true", help="create every missing topic now")
    parser.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    parser.add_argument(
        "--strimzi-cluster",
        default="my-cluster",
        metavar="NAME",
        help="the Kafka resource the KafkaTopics belong to (label strimzi.io/cluster)",
    )
    parser.add_argument("--namespace", default="", help="metadata.namespace of the KafkaTopics")


def kafka_topics_commands(plan: Iterable[TopicSpec], bootstrap: str) -> str:
    lines = [
        "# sandbox-lanes topics: create with kafka-topics.sh (add --command-config FILE on a secured cluster)"
    ]
    for spec in plan:
        args = [
            "kafka-topics.sh",
            "--bootstrap-server",
            bootstrap,
            "--create",
            "--if-not-exists",
            "--topic",
            spec.name,
            "--partitions",
            str(spec.partitions),
        ]
        if spec.replication != BROKER_DEFAULT:
            args += ["--replication-factor", str(spec.replication)]
        for key, value in spec.configs.items():
            args += ["--config", f"{key}={value}"]
        lines += [f"# {_ROLE_NOTE[spec.role]}", shlex.join(args)]
    return "\n".join(lines) + "\n"


_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def strimzi_topics(plan: Iterable[TopicSpec], cluster: str, namespace: str = "") -> str:
    docs = []
    for spec in plan:
        name = spec.name.lower().replace("_", "-")
        metadata: dict[str, object] = {"name": name, "labels": {"strimzi.io/cluster": cluster}}
        if namespace:
            metadata["namespace"] = namespace
        body: dict[str, object] = {}
        if name != spec.name or not _K8S_NAME.match(name):  # not a valid resource name as is
            body["topicName"] = spec.name
        body["partitions"] = spec.partitions
        if spec.replication != BROKER_DEFAULT:  # absent: the broker's default.replication.factor
            body["replicas"] = spec.replication
        if spec.configs:
            body["config"] = dict(spec.configs)
        doc = {
            "apiVersion": "kafka.strimzi.io/v1beta2",
            "kind": "KafkaTopic",
            "metadata": metadata,
            "spec": body,
        }
        docs.append(f"# {_ROLE_NOTE[spec.role]}\n" + yaml.safe_dump(doc, sort_keys=False))
    return "---\n".join(docs)


async def apply(settings: Settings, bootstrap: str) -> list[str]:
    """Create every missing topic of the plan; the names created."""
    from aiokafka.admin import AIOKafkaAdminClient

    from consumers.runtime.kafka.topology import check_co_partitioned, create_missing

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **settings.kafka_security.client_options())
    await admin.start()
    try:
        created = await create_missing(
            admin, plan_topics(settings.topics, settings.partitions, settings.replication)
        )
        await check_co_partitioned(admin, settings.topics)
        return created
    finally:
        await admin.close()


async def create_input_topics(settings: Settings, bootstrap: str | None = None) -> list[str]:
    """Create the missing input topics only (what the producing side does before a pod starts: the demo,
    the tests); the names created. The pod then creates its own topics itself."""
    from aiokafka.admin import AIOKafkaAdminClient

    from consumers.runtime.kafka.topology import create_missing

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap or settings.bootstrap, **settings.kafka_security.client_options()
    )
    await admin.start()
    try:
        plan = plan_topics(settings.topics, settings.partitions, settings.replication)
        return await create_missing(admin, tuple(s for s in plan if s.role == "input"))
    finally:
        await admin.close()


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    bootstrap = args.bootstrap or settings.bootstrap
    plan = plan_topics(settings.topics, settings.partitions, settings.replication)
    if not args.apply:
        if args.format == "strimzi":
            sys.stdout.write(strimzi_topics(plan, args.strimzi_cluster, args.namespace))
        else:
            sys.stdout.write(kafka_topics_commands(plan, bootstrap))
        return 0
    created = asyncio.run(apply(settings, bootstrap))  # a refusal or no broker: one line, exit 2 (cli)
    existing = [s.name for s in plan if s.name not in created]
    for name in created:
        print(f"created {name}")
    for name in existing:
        print(f"exists  {name}")
    return 0
