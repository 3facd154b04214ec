"""librdkafka's transactional producer (confluent-kafka) for one partition number, on asyncio.

The pod's ``exactly_once`` writes go through this: a record is handed to librdkafka with one C
call (``produce``: no Python future, no Python batch building, the network in librdkafka's own
threads), and the calls that wait on the broker (``init_transactions``, the offsets, the
commit, the abort) run in the producer's own daemon thread, so the event loop never blocks on
them.

Every such wait has a deadline in the pod (``timeout_s`` plus :data:`DEADLINE_GRACE_S`):
librdkafka does not always honour its own timeout (``send_offsets_to_transaction`` waits on
past it when the group coordinator goes away: librdkafka issues 5456 and 5511). Past the deadline the call
raises :class:`BrokerWaitExpired` and the producer is *abandoned*: its thread may stay blocked
inside librdkafka, which is why it is a daemon thread (an interpreter exit never waits on it)
and why nothing is ever asked of that producer again; the pod takes the partition over anew
with a new producer (a new epoch, which resolves the abandoned transaction on the broker).

The fence is the one :mod:`consumers.runtime.kafka.sink` describes: one transactional id per
input partition number; ``init_transactions`` bumps its epoch. The group metadata carries the
group id only (generation -1), as the per-partition ids need: the broker then checks the
epoch, not the group generation (KIP-447's per-pod mode is not used).

librdkafka's errors are translated at this edge into the pod's vocabulary: a fenced producer
raises :class:`aiokafka.errors.ProducerFenced`; a record librdkafka refuses for its content raises
:class:`RecordRefused`, one the broker refuses aiokafka's class for the broker's code (size,
corruption: :mod:`failures` counts both as deterministic); every other error is a
:class:`TransactionError` of the world (retried).

A record the broker refuses in the middle of a transaction puts librdkafka in its *abortable*
state: every later ``produce()`` of the transaction fails with ``_STATE``, which says nothing of
why. The reason is in the refused record's delivery report; ``produce()`` then serves the reports
(waiting for them up to the deadline) and raises the refused record's own error, naming it, so the
pod sees the record's fault (and its one-record mode finds the record), not the world's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from aiokafka import TopicPartition
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as RdTopicPartition

from consumers.runtime.kafka.producer_errors import (
    PURGED_CODES,
    BrokerWaitExpired,
    TransactionError,
    as_aiokafka,
    named,
    translate,
)
from consumers.runtime.kafka.producer_thread import Worker
from consumers.runtime.loop_watch import bounded_wait

logger = logging.getLogger("sandbox_lanes.librdkafka")

_T = TypeVar("_T")

#: How much longer than the timeout it was given the pod waits for a librdkafka call to return.
DEADLINE_GRACE_S: Final = 5.0
#: How often a full producer queue is looked at again (the loop yields in between: no spinning).
_QUEUE_FULL_WAIT_S: Final = 0.01


def group_metadata(group_id: str) -> object:
    """The group metadata ``send_offsets_to_transaction`` takes, with the group id only.

    librdkafka builds it from a consumer configured with the group; this one has no broker and
    never subscribes, so its generation stays -1 (what a per-partition transactional id commits
    with).
    """
    consumer = Consumer({"group.id": group_id, "enable.auto.commit": False, "log_level": 0})
    try:
        return consumer.consumer_group_metadata()
    finally:
        consumer.close()


class TxnProducer:
    """One transactional librdkafka producer, driven from asyncio."""

    def __init__(
        self,
        config: Mapping[str, Any],
        transactional_id: str,
        metadata: object,
        *,
        timeout_s: float,
    ) -> None:
        self._producer: Producer | None = Producer(
            {
                **config,
                "transactional.id": transactional_id,
                "logger": logger,
                # Every record's report: a failed one names the topic the commit's error leaves
                # out; a delivered one gives its offset (the state store's checkpoint, see
                # :meth:`written`).
                "on_delivery": self._delivered,
            }
        )
        #: The first record that failed in the open transaction: its error, and it in words.
        self._failed: tuple[KafkaError, str] | None = None
        #: Records of the open transaction whose delivery failed after the first (its batch-mates:
        #: the broker refuses a whole batch).
        self._failed_more = 0
        #: The first record purged unsent (only a consequence: said when nothing else failed).
        self._purged: tuple[KafkaError, str] | None = None
        #: The open transaction's records handed over with an explicit partition, per (topic,
        #: partition), and of those delivered: [first offset, last offset, count].
        self._sent: dict[tuple[str, int], int] = {}
        self._delivered_at: dict[tuple[str, int], list[int]] = {}
        self._metadata = metadata
        self._timeout_s = timeout_s
        #: librdkafka is given ``timeout_s``; the pod waits this long at most.
        self.deadline_s = timeout_s + DEADLINE_GRACE_S
        self.transactional_id = transactional_id
        self._worker = Worker(f"sandbox-lanes-txn-{transactional_id}")
        #: A broker wait outlived its deadline, or an abort failed: nothing more is asked of it.
        self.abandoned = False

    @property
    def _handle(self) -> Producer:
        if self._producer is None or self.abandoned:
            raise BrokerWaitExpired(f"{self.transactional_id}: the producer was abandoned or closed")
        return self._producer

    def _delivered(self, error: KafkaError | None, message: Any) -> None:
        if error is None:
            place = (message.topic(), message.partition())
            if place in self._sent:
                offset = message.offset()
                seen = self._delivered_at.get(place)
                if seen is None:
                    self._delivered_at[place] = [offset, offset, 1]
                else:
                    seen[0], seen[1], seen[2] = min(seen[0], offset), max(seen[1], offset), seen[2] + 1
            return
        if error.code() in PURGED_CODES:
            if self._purged is None:
                self._purged = (error, named(message))
        elif self._failed is None:
            self._failed = (error, named(message))
        else:
            self._failed_more += 1

    def written(self, topic: str, partition: int) -> tuple[int, int] | None:
        """The first and last offsets of the committed transaction's records in ``topic``
        ``partition`` (handed over with that partition), when they are known to be all of them and
        contiguous (no other writer's record between them); else None. Read after :meth:`commit`
        (whose flush serves every delivery report) and before the next :meth:`begin`."""
        place = (topic, partition)
        sent = self._sent.get(place, 0)
        seen = self._delivered_at.get(place)
        if not sent or seen is None:
            return None
        first, last, count = seen
        if count != sent or last - first + 1 != count:
            return None
        return first, last

    async def _blocking(self, call: Callable[..., _T], *args: Any) -> _T:
        """``call(*args)`` in the producer's thread, awaited up to :attr:`deadline_s`."""
        future = self._worker.submit(lambda: call(*args))
        name = getattr(call, "__name__", "a call")
        try:
            with bounded_wait(f"{self.transactional_id}: {name}", self.deadline_s):
                return await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except TimeoutError:
            self.abandoned = True
            # Its late answer is nobody's: dropped (a cancelled future takes none), never left to be
            # reported unretrieved, as a callback's retrieval was when the loop ended before it ran.
            future.cancel()
            raise BrokerWaitExpired(
                f"{self.transactional_id}: {name} did not return within {self.deadline_s:g}s"
            ) from None
        except asyncio.CancelledError:
            # The caller stopped waiting (a shutdown bound): the call may still be running in
            # the thread, so the producer is no longer in a known state.
            self.abandoned = True
            future.cancel()
            raise
        except KafkaException as exc:
            refusal = self._first_failure()
            if refusal is not None:  # the record behind the failure: its own code, it named
                raise refusal from exc
            raise translate(exc) from exc

    async def init(self) -> None:
        """InitProducerId: bumps the epoch, aborts (or waits out) a previous owner's open transaction."""
        producer = self._handle
        producer.poll(0)  # serves an OAUTHBEARER token callback before the first request
        await self._blocking(producer.init_transactions, self._timeout_s)

    def begin(self) -> None:
        self._failed = self._purged = None
        self._failed_more = 0
        self._sent = {}
        self._delivered_at = {}
        try:
            self._handle.begin_transaction()
        except KafkaException as exc:
            raise translate(exc) from exc

    async def produce(
        self, topic: str, value: bytes | None, key: bytes, headers: Any, partition: int | None
    ) -> None:
        """Hand one record to librdkafka (no network wait).

        A full queue is waited on without blocking the loop (deliveries free it), up to the
        deadline: a queue that stays full means the broker is not taking records.
        """
        kwargs: dict[str, Any] = {"key": key, "value": value}
        if headers:
            kwargs["headers"] = headers
        if partition is not None:
            kwargs["partition"] = partition
        producer = self._handle
        try:
            self._hand_over(producer, topic, kwargs, partition)
            return
        except BufferError:
            pass  # the queue is full: deliveries free it
        except KafkaException as exc:
            raise await self._refused(producer, exc) from exc
        give_up_at = time.monotonic() + self.deadline_s
        with bounded_wait(f"{self.transactional_id}: a full producer queue", self.deadline_s):
            while True:
                producer.poll(0)  # serves delivery reports without waiting
                await asyncio.sleep(_QUEUE_FULL_WAIT_S)
                try:
                    self._hand_over(producer, topic, kwargs, partition)
                    return
                except BufferError:
                    if time.monotonic() > give_up_at:
                        self.abandoned = True
                        full = f"the producer's queue stayed full for {self.deadline_s:g}s"
                        raise BrokerWaitExpired(f"{self.transactional_id}: {full}") from None
                except KafkaException as exc:
                    raise await self._refused(producer, exc) from exc

    def _hand_over(
        self, producer: Producer, topic: str, kwargs: dict[str, Any], partition: int | None
    ) -> None:
        producer.produce(topic, **kwargs)
        if partition is not None:
            place = (topic, partition)
            self._sent[place] = self._sent.get(place, 0) + 1

    async def _refused(
        self, producer: Producer, exc: KafkaException, *, at_commit: bool = False
    ) -> BaseException:
        """What a failed ``produce()`` (or, ``at_commit``, a failed commit) means.

        ``_STATE`` in an open transaction: an earlier record failed (the broker refused it) and
        librdkafka waits for an abort; that record's delivery report holds the reason. The reports
        are served (a flush, up to the deadline: the refused record's report follows the state
        change at once, the others as the broker answers) and the first failed record's error is
        the answer, naming it. A failed commit: the reports already queued are served (librdkafka
        fails the commit at once when a refusal came first, ``_INCONSISTENT`` or the refusal's own
        code, its reports unserved) and a failed record's error, naming it, is the answer.
        Otherwise the error as it is."""
        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        refusal: BaseException | None = None
        if error is not None and error.code() == KafkaError._STATE:
            producer.poll(0)  # reports already queued
            if self._failed is None:
                try:
                    await self._blocking(producer.flush, self._timeout_s)
                except Exception as flush_failed:  # the world's (a deadline: abandoned): as it is
                    return flush_failed
            refusal = self._first_failure(purged_too=True)
        elif error is not None and at_commit and not error.fatal():  # a fence is the commit's own answer
            producer.poll(0)
            refusal = self._first_failure(purged_too=error.code() == KafkaError._INCONSISTENT)
        return translate(exc) if refusal is None else refusal

    def _first_failure(self, *, purged_too: bool = False) -> BaseException | None:
        """The open transaction's first failed record's error, naming it (and how many failed with
        it), in the pod's vocabulary; else, with ``purged_too``, the first record purged unsent;
        None when no delivery has failed."""
        if self._failed is None:
            if purged_too and self._purged is not None:
                return as_aiokafka(*self._purged)
            return None
        error, named = self._failed
        if self._failed_more:
            named += f" (and {self._failed_more} more records that failed after it)"
        return as_aiokafka(error, named)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """The input offsets into the transaction, then its commit (flushes every record first).

        A record the broker refused can show first here, before its delivery report was served: as
        ``_STATE`` (the offsets' request met the transaction already abortable), as the commit's
        ``_INCONSISTENT`` ("failed delivery, see individual delivery reports") or as the refusal's
        own code with no record named. The reports are served then, and the refused record's own
        error is the answer, as in ``produce()``."""
        producer = self._handle
        try:
            if offsets:
                await self._blocking(
                    producer.send_offsets_to_transaction,
                    [RdTopicPartition(tp.topic, tp.partition, off) for tp, off in offsets.items()],
                    self._metadata,
                    self._timeout_s,
                )
            await self._blocking(producer.commit_transaction, self._timeout_s)
        except Exception as exc:
            cause = exc.__cause__
            if isinstance(cause, KafkaException) and not self.abandoned:
                answer = await self._refused(producer, cause, at_commit=True)
                if str(answer) != str(exc):  # a record named, or a flush's own failure
                    raise answer from exc
            raise

    async def flush(self) -> None:
        """Wait until every record handed over so far is on the broker (still uncommitted)."""
        producer = self._handle
        await self._blocking(producer.flush, self._timeout_s)

    async def abort(self) -> None:
        producer = self._handle
        try:
            await self._blocking(producer.abort_transaction, self._timeout_s)
        except BaseException:
            self.abandoned = True  # an abort that failed leaves the producer in no known state
            raise

    def close(self) -> None:
        """Drop what is queued and release librdkafka's handle, off the loop, without waiting.

        The handle is purged and destroyed in a daemon thread of its own (its worker may be stuck
        in a broker wait): the loop never blocks on it, and an interpreter exit never waits on it.
        The pod keeps no reference, so the handle is destroyed by that thread, not by the garbage
        collector on the loop thread.
        """
        producer, self._producer = self._producer, None
        self.abandoned = True
        self._worker.stop()
        if producer is None:
            return

        def destroy(handle: Producer) -> None:
            with contextlib.suppress(Exception):  # a fatal producer refuses purge; destroyed all the same
                handle.purge()
                handle.flush(0)

        closer = threading.Thread(
            target=destroy, args=(producer,), name=f"sandbox-lanes-close-{self.transactional_id}", daemon=True
        )
        closer.start()
        _LINGERING.append((self._worker.thread, closer))
        del producer


#: Producers closed whose threads have not ended yet (a worker stuck in a broker wait, a destroy
#: waiting on librdkafka): each holds a librdkafka handle and its threads until the broker answers.
_LINGERING: list[tuple[threading.Thread, threading.Thread]] = []
#: At most this many may linger: past it no new producer is opened (a take-over or reopen waits
#: with its backoff), so an outage cannot pile up handles and threads without bound.
MAX_LINGERING: Final = 32


def lingering() -> int:
    """How many closed producers still have a thread alive (the pod's gauge, and the cap's count)."""
    _LINGERING[:] = [pair for pair in _LINGERING if pair[0].is_alive() or pair[1].is_alive()]
    return len(_LINGERING)


class TooManyLingering(TransactionError):
    """:data:`MAX_LINGERING` closed producers are still stuck in broker waits: no new one is opened
    until some have ended (a failure of the world: waited out with backoff)."""
