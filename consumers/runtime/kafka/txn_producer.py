"""librdkafka's transactional producer (confluent-kafka) for one partition number, on asyncio.

The pod's ``exactly_once`` writes go through this: a record is handed to librdkafka with one C
call (``produce``: no Python future, no Python batch building, the network in librdkafka's own
threads), and the calls that wait on the broker (``init_transactions``, the offsets, the
commit, the abort) run in a thread of their own executor, so the event loop never blocks on
them. The fence is the one :mod:`consumers.runtime.kafka.sink` describes: one transactional id per
input partition number; ``init_transactions`` bumps its epoch. The group metadata carries the
group id only (generation -1), as the per-partition ids need: the broker then checks the
epoch, not the group generation (KIP-447's per-pod mode is not used).

librdkafka's errors are translated at this edge into the pod's vocabulary: a fenced producer
raises :class:`aiokafka.errors.ProducerFenced`; a record the broker refuses for its content
(size, timestamp, corruption) raises :class:`RecordRefused`, which :mod:`failures` counts as
deterministic; every other error is a :class:`TransactionError` of the world (retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError as AioKafkaError
from aiokafka.errors import ProducerFenced, for_code
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as RdTopicPartition

logger = logging.getLogger("sandbox_lanes.librdkafka")

_T = TypeVar("_T")

#: librdkafka's own codes for a record refused for its content (a broker's refusal has a broker code).
_LOCAL_RECORD_CODES: Final = frozenset({KafkaError._INVALID_ARG, KafkaError._BAD_MSG})


class TransactionError(AioKafkaError):  # type: ignore[misc]
    """A librdkafka failure of its own (local codes: transport, timeout, state): retried."""


class RecordRefused(TransactionError):
    """librdkafka refused a record for its content before sending it: deterministic."""


def translate(exc: BaseException) -> BaseException:
    """librdkafka's exception as aiokafka's class for the same broker code, so one vocabulary
    (:mod:`failures`, the fence) serves both clients."""
    if not isinstance(exc, KafkaException) or not exc.args or not isinstance(exc.args[0], KafkaError):
        return exc
    return _as_aiokafka(exc.args[0])


def _as_aiokafka(error: KafkaError, where: str = "") -> BaseException:
    """``where``: the failed record's topic and partition, when a delivery report named them."""
    code = error.code()
    message = f"{where}: {error.str()}" if where else f"{error.name()}: {error.str()}"
    translated: BaseException
    if code in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
        translated = ProducerFenced(message)
    elif code in _LOCAL_RECORD_CODES:
        translated = RecordRefused(message)
    elif code > 0:  # the broker's code: aiokafka's class for it (MessageSizeTooLargeError, ...)
        translated = for_code(code)(message)
    else:
        translated = TransactionError(message)
    return translated


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
        executor: ThreadPoolExecutor,
        *,
        timeout_s: float,
    ) -> None:
        self._producer = Producer(
            {
                **config,
                "transactional.id": transactional_id,
                "logger": logger,
                # A report for a failed record only: it names the topic the commit's error leaves out.
                "delivery.report.only.error": True,
                "on_delivery": self._delivered,
            }
        )
        #: The first record that failed in the open transaction: its error, topic and partition.
        self._failed: tuple[KafkaError, str] | None = None
        self._metadata = metadata
        self._executor = executor
        self._timeout_s = timeout_s
        self.transactional_id = transactional_id

    def _delivered(self, error: KafkaError | None, message: Any) -> None:
        if error is not None and self._failed is None:
            topic, partition = message.topic(), message.partition()
            known = partition is not None and partition >= 0  # not assigned: the topic was refused
            self._failed = (error, f"{topic} [{partition}]" if known else topic)

    async def _blocking(self, call: Callable[..., _T], *args: Any) -> _T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call, *args)
        except KafkaException as exc:
            failed = self._failed
            if failed is not None:  # the record behind the failure: its own code, its topic named
                raise _as_aiokafka(failed[0], failed[1]) from exc
            raise translate(exc) from exc

    async def init(self) -> None:
        """InitProducerId: bumps the epoch, aborts (or waits out) a previous owner's open transaction."""
        self._producer.poll(0)  # serves an OAUTHBEARER token callback before the first request
        await self._blocking(self._producer.init_transactions, self._timeout_s)

    def begin(self) -> None:
        self._failed = None
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise translate(exc) from exc

    def produce(
        self, topic: str, value: bytes | None, key: bytes, headers: Any, partition: int | None
    ) -> None:
        """Hand one record to librdkafka (no network wait); a full queue is served first."""
        kwargs: dict[str, Any] = {"key": key, "value": value}
        if headers:
            kwargs["headers"] = headers
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                return
            except BufferError:
                self._producer.poll(0.05)  # the queue is full: deliveries free it
            except KafkaException as exc:
                raise translate(exc) from exc

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """The input offsets into the transaction, then its commit (flushes every record first)."""
        if offsets:
            await self._blocking(
                self._producer.send_offsets_to_transaction,
                [RdTopicPartition(tp.topic, tp.partition, off) for tp, off in offsets.items()],
                self._metadata,
                self._timeout_s,
            )
        await self._blocking(self._producer.commit_transaction, self._timeout_s)

    async def flush(self) -> None:
        """Wait until every record handed over so far is on the broker (still uncommitted)."""
        await self._blocking(self._producer.flush, self._timeout_s)

    async def abort(self) -> None:
        await self._blocking(self._producer.abort_transaction, self._timeout_s)

    async def close(self) -> None:
        """Drop what is queued and release librdkafka's threads (in the executor: it may block)."""

        producer = self._producer

        def destroy() -> None:
            producer.purge()
            producer.flush(0)

        with contextlib.suppress(Exception):  # a fatal producer refuses purge; it is dropped all the same
            await asyncio.get_running_loop().run_in_executor(self._executor, destroy)
