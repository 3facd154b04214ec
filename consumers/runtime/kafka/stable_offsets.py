"""The committed input offsets a take-over seeks to, read *stably* (KIP-447's ``require_stable``).

Under ``exactly_once`` a partition's input offsets are committed inside its transactions, beside the
state records. The group coordinator keeps a transaction's offsets *pending* until the transaction's
marker reaches ``__consumer_offsets``, and a plain OffsetFetch answers with the offsets materialised
so far. An offset read that overtakes a marker seeks a new owner back before inputs whose state the
restore then reads from the state topic (committed there already): they are fetched again and ignored
as duplicates. No outcome goes wrong (the state's dedupe holds), but it is work redone and it breaks
"no input ignored but a true duplicate" (docs/guarantees.md). aiokafka's consumer speaks OffsetFetch
versions 0-3, which cannot ask for stable offsets; librdkafka's admin client can. With
``require_stable`` the coordinator answers ``UNSTABLE_OFFSET_COMMIT`` while offsets of an open
transaction are pending for the group (Kafka 4's coordinator also orders the read after every write
it has taken), and the read is asked again, briefly, until it is stable; the caller's deadline
bounds the whole wait, as every other broker wait of a take-over.

Each read opens librdkafka's admin client and releases it off the loop once answered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

from aiokafka import TopicPartition
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException
from confluent_kafka import TopicPartition as RdTopicPartition
from confluent_kafka.admin import AdminClient

from consumers.runtime.kafka.producer_errors import as_aiokafka, translate
from resilience.backoff import Backoff

logger = logging.getLogger("sandbox_lanes.librdkafka")

#: The first and the longest pause before asking again while the group's offsets are pending (a
#: transaction's markers are written within milliseconds of its commit; an open one ends within its
#: timeout).
_UNSTABLE_FIRST_S: Final = 0.02
_UNSTABLE_CAP_S: Final = 0.5


#: The group's coordinator is loading, moving or away: asked again, as aiokafka's own read does.
_COORDINATOR_CODES: Final = frozenset(
    {
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
    }
)


class AskAgain(Exception):
    """An answer that says to ask again shortly (the caller's deadline bounds how long)."""


class Unstable(AskAgain):
    """The group still had pending transactional offsets for these partitions."""


class StableOffsets:
    """Reads one group's committed offsets with ``require_stable`` (librdkafka's admin client).

    Each read opens an admin client of its own and releases it when answered: take-overs are rare,
    and a handle kept between them would hold its threads and connections, and queue its log lines
    (served only when polled) through an outage for nothing."""

    def __init__(self, config: Mapping[str, Any], group_id: str, *, timeout_s: float) -> None:
        #: librdkafka options (bootstrap, security; a producer's own options are accepted and unused).
        self._config = {**config, "logger": logger}
        self._group_id = group_id
        self._timeout_s = timeout_s

    async def read(self, tps: Sequence[TopicPartition]) -> list[int | None]:
        """The committed offset of each of ``tps`` (None: none committed), once none is pending.

        Asked again here, after a short backoff: "unstable", and a coordinator loading or moving
        (aiokafka's read retried those too). Any other failure (a timeout, authorisation) is raised
        as aiokafka's class for its code, for the caller's failure policy."""
        if not tps:
            return []
        again = Backoff(first_s=_UNSTABLE_FIRST_S, cap_s=_UNSTABLE_CAP_S)
        admin = AdminClient(self._config)
        try:
            while True:
                try:
                    return await self._ask(admin, tps)
                except AskAgain:
                    await asyncio.sleep(again.failed())
        finally:
            _release_soon(admin)
            del admin

    async def read_once(self, tps: Sequence[TopicPartition]) -> list[int | None]:
        """One OffsetFetch with ``require_stable``: :class:`Unstable` while offsets are pending,
        :class:`AskAgain` while the coordinator loads or moves."""
        admin = AdminClient(self._config)
        try:
            return await self._ask(admin, tps)
        finally:
            _release_soon(admin)
            del admin

    async def _ask(self, admin: AdminClient, tps: Sequence[TopicPartition]) -> list[int | None]:
        request = ConsumerGroupTopicPartitions(
            self._group_id, [RdTopicPartition(tp.topic, tp.partition) for tp in tps]
        )
        futures = admin.list_consumer_group_offsets(
            [request], require_stable=True, request_timeout=self._timeout_s
        )
        try:
            answer = await asyncio.wrap_future(futures[self._group_id])
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if _unstable(error):
                raise Unstable(str(exc)) from exc
            if isinstance(error, KafkaError) and error.code() in _COORDINATOR_CODES:
                raise AskAgain(str(exc)) from exc
            raise translate(exc) from exc
        finally:
            admin.poll(0)  # its log lines, to the pod's logger
        found: dict[tuple[str, int], int | None] = {}
        for tp in answer.topic_partitions or []:
            if tp.error is not None:
                if _unstable(tp.error):
                    raise Unstable(f"{tp.topic} [{tp.partition}]: {tp.error}")
                if tp.error.code() in _COORDINATOR_CODES:
                    raise AskAgain(f"{tp.topic} [{tp.partition}]: {tp.error}")
                raise as_aiokafka(tp.error, f"{tp.topic} [{tp.partition}]")
            found[(tp.topic, tp.partition)] = None if tp.offset < 0 else tp.offset  # -1001: none
        return [found.get((tp.topic, tp.partition)) for tp in tps]


def _release_soon(admin: AdminClient) -> None:
    """Release the admin client in a daemon thread: librdkafka's destroy may wait on a broker."""
    threading.Thread(target=_release, args=(admin,), name="sandbox-lanes-close-offsets", daemon=True).start()


def _release(handle: AdminClient) -> None:
    """Holds the last reference: the handle is destroyed when this returns, in this thread."""
    del handle


def _unstable(error: Any) -> bool:
    return isinstance(error, KafkaError) and error.code() == KafkaError.UNSTABLE_OFFSET_COMMIT
