"""The topology: which topics exist, how they are configured, and how they relate.

Kept apart from the runtime (as Kafka Streams separates a Topology from the
KafkaStreams instance running it): the pod, the CLI, the tests and the chaos
harness share these names and creation rules.

The plan (:func:`plan_topics`) is what ``sandbox-lanes topics`` prints or applies. The pod itself
(:func:`prepare_pod_topics`) never creates an input topic: the inputs belong to the producing side,
and a pod that created them with its own partition count would fix the co-partitioning of a topic
it does not own. It checks that they exist, and creates only its own missing topics (state,
outcomes, dead letters), with the inputs' partition count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, TopicAuthorizationFailedError, for_code

from events.codec import TYPE_PREFIX, lane_config_topic
from events.sandbox_lanes.v1 import inputs_pb2

logger = logging.getLogger("sandbox_lanes.topology")

INPUT_TYPE_CREATED = TYPE_PREFIX + inputs_pb2.ExecutionCreated.DESCRIPTOR.name
INPUT_TYPE_PHASE_CHANGED = TYPE_PREFIX + inputs_pb2.PhaseChanged.DESCRIPTOR.name
INPUT_TYPE_SESSION_DELETED = TYPE_PREFIX + inputs_pb2.SessionDeleted.DESCRIPTOR.name


@dataclass(frozen=True)
class Topics:
    execution_created: str = "execution-created"
    phase_changed: str = "phase-changed"
    session_deleted: str = "session-deleted"
    outcomes: str = "sandbox-outcomes"
    state: str = "sandbox-lanes-state"
    dead_letter: str = "sandbox-lanes-dlq"
    #: A cap is on: the capacity ledger's three topics exist and the pod reads its admissions.
    capacity_on: bool = False

    @property
    def inputs(self) -> tuple[str, ...]:
        """Upstream's input topics (the producers' own)."""
        return (self.execution_created, self.phase_changed, self.session_deleted)

    @property
    def consumed(self) -> tuple[str, ...]:
        """What the pod's loop reads: the inputs, and the capacity ledger's answers when a cap is on."""
        return (*self.inputs, self.admissions) if self.capacity_on else self.inputs

    @property
    def capacity(self) -> str:
        """The capacity log (one partition): requests and releases, the ledger owner's ticks."""
        return self.state + "-capacity"

    @property
    def capacity_ledger(self) -> str:
        """The ledger's changelog (one partition, compacted): a claim per sandbox counted or awaited."""
        return self.state + "-capacity-ledger"

    @property
    def admissions(self) -> str:
        """The ledger's answers, to the execution's partition: co-partitioned with the inputs."""
        return self.state + "-admissions"

    @property
    def lane_config(self) -> str:
        """The compacted topic of the lane configuration records (one partition), beside the state."""
        return lane_config_topic(self.state)

    def carries(self, topic: str) -> str | None:
        """The one input event type (``ce_type``) ``topic`` carries; None for a topic not an input."""
        return {
            self.execution_created: INPUT_TYPE_CREATED,
            self.phase_changed: INPUT_TYPE_PHASE_CHANGED,
            self.session_deleted: INPUT_TYPE_SESSION_DELETED,
        }.get(topic)

    @property
    def co_partitioned(self) -> tuple[str, ...]:
        """Inputs and state: partition N of the state holds the keys of partition N of each input."""
        return (*self.consumed, self.state)

    def all(self) -> tuple[str, ...]:
        ledger = (self.capacity, self.capacity_ledger) if self.capacity_on else ()
        return (*self.co_partitioned, self.outcomes, self.dead_letter, *ledger)


#: The broker's default (``default.replication.factor``), as ``kafka-topics.sh`` without the flag.
BROKER_DEFAULT = -1
#: A deleted key's tombstone stays readable this long: a consumer restoring the state (a pod taking
#: partitions over, ``replay``, ``tail --state``) that started reading before the compaction still
#: sees the delete. A day, so a restore that stalls or a pod that stays down for hours misses none.
TOMBSTONE_RETENTION_MS = 24 * 3600 * 1000
#: A state record is never compacted away within its first hour: the recent history of an execution
#: stays whole for ``tail --state`` and ``replay`` while it is being diagnosed.
MIN_COMPACTION_LAG_MS = 3600 * 1000
#: Dead letters wait for a human: four weeks, so a holiday does not cost one.
DEAD_LETTER_RETENTION_MS = 28 * 24 * 3600 * 1000

STATE_TOPIC_CONFIG: dict[str, str] = {
    "cleanup.policy": "compact",
    "min.cleanable.dirty.ratio": "0.1",
    "segment.ms": "600000",
    "min.compaction.lag.ms": str(MIN_COMPACTION_LAG_MS),
    "delete.retention.ms": str(TOMBSTONE_RETENTION_MS),
}
DEAD_LETTER_TOPIC_CONFIG: dict[str, str] = {
    "cleanup.policy": "delete",
    "retention.ms": str(DEAD_LETTER_RETENTION_MS),
}

#: The capacity log is the ledger's whole input: kept for ever (about 150 bytes a request, a release or
#: a tick; ticks only while a create waits), so ``replay`` re-derives every admission from its first.
#: An operator may bound it (``retention.ms``) where the audit does not need more (docs/operations.md).
CAPACITY_LOG_CONFIG: dict[str, str] = {"cleanup.policy": "delete", "retention.ms": "-1"}

Role = Literal["input", "state", "output", "dead-letter", "config", "capacity"]


def min_insync_replicas(replication: int) -> int | None:
    """2 from 3 replicas on (a write survives one broker down and is on 2), 1 below; ``None`` for
    the broker's default replication: the topic then inherits the broker's ``min.insync.replicas``,
    set by the same platform team that set ``default.replication.factor``."""
    if replication == BROKER_DEFAULT:
        return None
    return 2 if replication >= 3 else 1


@dataclass(frozen=True)
class TopicSpec:
    name: str
    role: Role
    partitions: int
    #: ``BROKER_DEFAULT`` (-1): the broker's ``default.replication.factor``.
    replication: int
    configs: Mapping[str, str] = field(default_factory=dict)
    #: One partition whatever the inputs have (read whole, or one order for the installation).
    single: bool = False

    @property
    def owned(self) -> bool:
        """Created by the pod when missing (inputs never are)."""
        return self.role != "input"


def plan_topics(topics: Topics, partitions: int, replication: int = BROKER_DEFAULT) -> tuple[TopicSpec, ...]:
    """Every topic with its settings: the inputs and state co-partitioned, ``partitions`` each."""
    isr = min_insync_replicas(replication)
    common = {} if isr is None else {"min.insync.replicas": str(isr)}
    roles: list[tuple[str, Role, Mapping[str, str]]] = [
        *((name, "input", {}) for name in topics.inputs),
        (topics.state, "state", STATE_TOPIC_CONFIG),
        (topics.outcomes, "output", {}),
        (topics.dead_letter, "dead-letter", DEAD_LETTER_TOPIC_CONFIG),
        (topics.lane_config, "config", {"cleanup.policy": "compact"}),
    ]
    single = {topics.lane_config}
    if topics.capacity_on:
        roles += [
            (topics.admissions, "capacity", {}),
            (topics.capacity, "capacity", CAPACITY_LOG_CONFIG),
            (topics.capacity_ledger, "capacity", STATE_TOPIC_CONFIG),
        ]
        single |= {topics.capacity, topics.capacity_ledger}
    return tuple(
        TopicSpec(
            name,
            role,
            1 if name in single else partitions,
            replication,
            {**configs, **common},
            name in single,
        )
        for name, role, configs in roles
    )


class TopologyError(RuntimeError):
    """The broker's topics cannot carry this topology (e.g. inputs not co-partitioned)."""


class MissingTopicsError(TopologyError):
    """Topics the pod does not create (the inputs, or every topic with creation off) are missing."""

    def __init__(self, missing: list[str], *, inputs: bool) -> None:
        self.missing = missing
        what = "input topic" if inputs else "topic"
        super().__init__(
            f"missing {what}{'s' if len(missing) > 1 else ''}: {', '.join(missing)} (the pod never creates "
            f"{'its inputs' if inputs else 'topics with SANDBOX_LANES_CREATE_TOPICS=false'}; create "
            f"{'them' if len(missing) > 1 else 'it'} first: `sandbox-lanes topics` prints the commands, "
            f"`sandbox-lanes topics --apply` runs them)"
        )


def _new_topic(spec: TopicSpec, partitions: int | None = None) -> NewTopic:
    """aiokafka's NewTopic refuses -1 (the broker's default) without a replica assignment on the client
    side; the broker (CreateTopics, KIP-464) takes it: the same request with the check skipped."""
    topic: NewTopic = NewTopic.__new__(NewTopic)
    topic.name = spec.name
    topic.num_partitions = spec.partitions if partitions is None else partitions
    topic.replication_factor = spec.replication
    topic.replica_assignments = {}
    topic.topic_configs = dict(spec.configs)
    return topic


async def create_missing(
    admin: AIOKafkaAdminClient, specs: tuple[TopicSpec, ...], partitions: int | None = None
) -> list[str]:
    """Create the topics of ``specs`` not on the broker (``partitions`` overrides theirs); the created
    names. A topic a concurrent creator made first counts as there; any other refusal raises."""
    existing, hidden = await _describe(admin, tuple(s.name for s in specs))
    missing = [s for s in specs if s.name not in existing and s.name not in hidden]
    if not missing:
        return []
    # The configuration records' topic keeps its one partition (it is read whole, keyed by
    # fingerprint), and so do the capacity log and ledger (one order for the installation).
    response: Any = await admin.create_topics(
        [_new_topic(s, None if s.single else partitions) for s in missing]
    )
    errors = []
    for topic, code, message in response.topic_errors:
        error = for_code(code)
        if code and error is not TopicAlreadyExistsError:
            errors.append(f"{topic}: {message or error.__name__}")
    if errors:
        raise TopologyError("cannot create topics: " + "; ".join(errors))
    names = [s.name for s in missing]
    logger.info("topics created", extra={"topics": ",".join(names)})
    # Metadata of just-created topics can lag behind the create response: look again briefly.
    for _ in range(50):
        counts = await _partition_counts(admin, tuple(names))
        if all(name in counts for name in names):
            break
        await asyncio.sleep(0.1)
    return names


#: How long a topic that was there (or was just created) may be missing from a broker's metadata
#: answer: on a cluster, the broker that answers may not have the new topic yet.
METADATA_LAG_S = 30.0


async def check_co_partitioned(
    admin: AIOKafkaAdminClient, topics: Topics, *, metadata_lag_s: float = METADATA_LAG_S
) -> int:
    """The shared partition count of the inputs and the state, or a TopologyError naming each.

    A topic absent from the answer is looked for again for up to ``metadata_lag_s`` (a just-created
    topic reaches each broker's metadata a moment later); a count that differs fails at once.
    """
    deadline = time.monotonic() + metadata_lag_s
    while True:
        counts = await _partition_counts(admin, topics.co_partitioned)
        wanted = {name: counts.get(name) for name in topics.co_partitioned}
        if None not in wanted.values() or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    if len(set(wanted.values())) != 1 or None in wanted.values():
        raise TopologyError(
            "input and state topics must have the same partition count (co-partitioning): "
            + ", ".join(f"{k}={v}" for k, v in wanted.items())
        )
    return next(iter(counts.values()))


async def prepare_pod_topics(
    admin: AIOKafkaAdminClient, topics: Topics, replication: int, *, create: bool
) -> None:
    """The pod's start: every input must exist; its own missing topics are created (``create``) with
    the inputs' partition count, else must exist too; inputs and state must be co-partitioned."""
    plan = plan_topics(topics, 1, replication)
    counts, hidden = await _describe(admin, topics.all())
    unreadable = [name for name in topics.co_partitioned if name in hidden]
    if unreadable:  # Read (or Write) on a topic implies Describe: these the pod can never consume
        raise TopologyError(
            f"not authorized to describe {', '.join(unreadable)} (see the ACLs in docs/operations.md)"
        )
    if hidden:  # an output it may not write: the first transaction writing it will name it
        logger.warning("not authorized to describe topics", extra={"topics": ",".join(sorted(hidden))})
    missing_inputs = [name for name in topics.inputs if name not in counts]
    if missing_inputs:
        raise MissingTopicsError(missing_inputs, inputs=True)
    if create:
        await create_missing(admin, tuple(s for s in plan if s.owned), counts[topics.execution_created])
    else:
        missing = [name for name in topics.all() if name not in counts and name not in hidden]
        if missing:
            raise MissingTopicsError(missing, inputs=False)
    await check_co_partitioned(admin, topics)


async def ensure_topics(
    admin: AIOKafkaAdminClient, topics: Topics, partitions: int, replication: int = BROKER_DEFAULT
) -> None:
    """Create every missing topic of the plan, inputs included (``topics --apply``, the demo, the bench,
    tests: whoever owns the inputs), then check that inputs and state are co-partitioned."""
    await create_missing(admin, plan_topics(topics, partitions, replication))
    await check_co_partitioned(admin, topics)


async def _partition_counts(admin: AIOKafkaAdminClient, names: tuple[str, ...]) -> dict[str, int]:
    return (await _describe(admin, names))[0]


async def _describe(admin: AIOKafkaAdminClient, names: tuple[str, ...]) -> tuple[dict[str, int], set[str]]:
    """Partition counts of the topics that exist, and the names this principal may not describe
    (they may exist: the broker does not say)."""
    described: list[dict[str, Any]] = await admin.describe_topics(list(names))
    counts: dict[str, int] = {}
    hidden: set[str] = set()
    for topic in described:
        code = topic.get("error_code", 0)
        if code == 0 and topic.get("partitions"):
            counts[topic["topic"]] = len(topic["partitions"])
        elif for_code(code) is TopicAuthorizationFailedError:
            hidden.add(topic["topic"])
    return counts, hidden
