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
it has taken), and the read is asked again, briefly, until it is stable, within the transaction
timeout (then :class:`StillUnstable`, the world's: the take-over is retried).

Each read runs in a daemon thread of its own, from the admin client's creation to its destruction
(librdkafka's destroy may wait on a broker, and an OAUTHBEARER token is fetched by a callback the
client's ``poll`` serves): nothing of it blocks the event loop. Its log lines go to the pod's logger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from aiokafka import TopicPartition
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException
from confluent_kafka import TopicPartition as RdTopicPartition
from confluent_kafka.admin import AdminClient

from consumers.runtime.kafka.producer_errors import TransactionError, as_aiokafka, translate
from consumers.runtime.kafka.producer_thread import Worker
from resilience.backoff import Backoff

logger = logging.getLogger("sandbox_lanes.librdkafka")

#: The first and the longest pause before asking again while the group's offsets are pending (a
#: transaction's markers are written within milliseconds of its commit; an open one ends within its
#: timeout).
_UNSTABLE_FIRST_S: Final = 0.02
_UNSTABLE_CAP_S: Final = 0.5
#: How much longer than its request's timeout an answer is waited for (librdkafka ends it by then).
_BACKSTOP_S: Final = 5.0
#: The group's coordinator is loading, moving or away: asked again, as aiokafka's own read does.
_COORDINATOR_CODES: Final = frozenset(
    {
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
    }
)


class AskAgain(Exception):
    """An answer that says to ask again shortly."""


class Unstable(AskAgain):
    """The group still had pending transactional offsets for these partitions."""


class StillUnstable(TransactionError):
    """No stable answer within the read's deadline (a failure of the world: the take-over retries)."""


class StableOffsets:
    """Reads one group's committed offsets with ``require_stable`` (librdkafka's admin client)."""

    def __init__(self, config: Mapping[str, Any], group_id: str, *, timeout_s: float) -> None:
        #: librdkafka options (bootstrap, security; a producer's own options are accepted and unused).
        self._config = {**config, "logger": logger}
        self._group_id = group_id
        #: How long one read may ask, all answers included; past it :class:`StillUnstable`.
        self._timeout_s = timeout_s
        #: Answers "unstable" or "coordinator not ready" seen so far (asked again each time).
        self.asked_again = 0

    async def read(self, tps: Sequence[TopicPartition]) -> list[int | None]:
        """The committed offset of each of ``tps`` (None: none committed), once none is pending.

        Asked again, after a short backoff, while the answer is "unstable" or the coordinator is
        loading or moving (aiokafka's read retried those too), up to the timeout; then
        :class:`StillUnstable` with the last answer. Any other failure (a timeout, authorisation) is
        raised as aiokafka's class for its code, for the caller's failure policy."""
        return await self._in_a_thread(tps, again=True)

    async def read_once(self, tps: Sequence[TopicPartition]) -> list[int | None]:
        """One OffsetFetch with ``require_stable``: :class:`Unstable` while offsets are pending,
        :class:`AskAgain` while the coordinator loads or moves."""
        return await self._in_a_thread(tps, again=False)

    async def _in_a_thread(self, tps: Sequence[TopicPartition], *, again: bool) -> list[int | None]:
        if not tps:
            return []
        worker = Worker("sandbox-lanes-stable-offsets")
        given_up = threading.Event()  # the caller stopped waiting (its deadline, a revocation)
        try:
            return await worker.submit(lambda: self._read_blocking(list(tps), again, given_up))
        finally:
            given_up.set()
            worker.stop()

    def _read_blocking(
        self, tps: list[TopicPartition], again: bool, given_up: threading.Event
    ) -> list[int | None]:
        """In the worker thread: the client made, asked, and destroyed here (the box holds the only
        reference, so no frame a traceback keeps can carry the handle to another thread)."""
        box = [AdminClient(self._config)]
        deadline = time.monotonic() + self._timeout_s
        backoff = Backoff(first_s=_UNSTABLE_FIRST_S, cap_s=_UNSTABLE_CAP_S)
        try:
            box[0].poll(0)  # serves an OAUTHBEARER token callback before the first request
            while True:
                try:
                    return self._ask(box, tps, deadline)
                except AskAgain as answer:
                    self.asked_again += 1
                    pause = backoff.failed()
                    if not again:
                        raise
                    if time.monotonic() + pause > deadline:
                        raise StillUnstable(
                            f"no stable committed offsets within {self._timeout_s:g} s: {answer}"
                        ) from None
                    if given_up.wait(pause):
                        raise StillUnstable("the caller stopped waiting") from None
        finally:
            box[0].poll(0)  # its log lines, to the pod's logger
            box.clear()  # destroyed here, in this thread

    def _ask(self, box: list[AdminClient], tps: list[TopicPartition], deadline: float) -> list[int | None]:
        request = ConsumerGroupTopicPartitions(
            self._group_id, [RdTopicPartition(tp.topic, tp.partition) for tp in tps]
        )
        remaining = max(0.1, deadline - time.monotonic())
        futures = box[0].list_consumer_group_offsets(
            [request], require_stable=True, request_timeout=remaining
        )
        try:  # librdkafka ends the request by its timeout; the wait's own bound is a backstop
            answer = futures[self._group_id].result(timeout=remaining + _BACKSTOP_S)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if _unstable(error):
                raise Unstable(str(exc)) from None
            if isinstance(error, KafkaError) and error.code() in _COORDINATOR_CODES:
                raise AskAgain(str(exc)) from None
            raise translate(exc) from None
        found: dict[tuple[str, int], int | None] = {}
        for tp in answer.topic_partitions or []:
            if tp.error is not None:
                if _unstable(tp.error):
                    raise Unstable(f"{tp.topic} [{tp.partition}]: {tp.error}")
                if tp.error.code() in _COORDINATOR_CODES:
                    raise AskAgain(f"{tp.topic} [{tp.partition}]: {tp.error}")
                raise as_aiokafka(tp.error, f"{tp.topic} [{tp.partition}]")
            found[(tp.topic, tp.partition)] = None if tp.offset < 0 else tp.offset  # -1001: none
        missing = [f"{tp.topic} [{tp.partition}]" for tp in tps if (tp.topic, tp.partition) not in found]
        if missing:
            raise TransactionError(f"the group's offsets came back without {', '.join(missing)}")
        return [found[(tp.topic, tp.partition)] for tp in tps]


def _unstable(error: Any) -> bool:
    return isinstance(error, KafkaError) and error.code() == KafkaError.UNSTABLE_OFFSET_COMMIT
