"""librdkafka's errors in aiokafka's classes: one vocabulary for both clients.

The pod reads every Kafka failure through :mod:`consumers.runtime.kafka.failures` and the failure
policy, which know aiokafka's classes; a librdkafka error is translated to the class aiokafka has for
the same broker code (a fence to ``ProducerFenced``, a record too large to
``MessageSizeTooLargeError``, ...), and librdkafka's own local codes to the few classes here.
"""

from __future__ import annotations

from typing import Any, Final

from aiokafka.errors import KafkaError as AioKafkaError
from aiokafka.errors import ProducerFenced, for_code
from confluent_kafka import KafkaError, KafkaException

#: librdkafka's own codes for a record refused for its content (a broker's refusal has a broker code).
_LOCAL_RECORD_CODES: Final = frozenset({KafkaError._INVALID_ARG, KafkaError._BAD_MSG})
#: The broker's refusals of a record for what it is that aiokafka has no class for: INVALID_RECORD
#: (87: e.g. a null key on a compacted topic) would otherwise be an UnknownError, the world's.
_BROKER_RECORD_CODES: Final = frozenset({KafkaError.INVALID_RECORD})
#: A record librdkafka dropped unsent because its transaction failed or aborted: a consequence,
#: never the cause (its report may even come before the cause's, or in the next transaction's).
PURGED_CODES: Final = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})


class TransactionError(AioKafkaError):  # type: ignore[misc]
    """A librdkafka failure of its own (local codes: transport, timeout, state): retried."""


class RecordRefused(TransactionError):
    """librdkafka refused a record for its content before sending it: deterministic."""


class FatalProducer(ProducerFenced):  # type: ignore[misc]
    """librdkafka made the producer fatal and answers ``_FATAL``: after a fence (its ``produce``
    then raises ``_FATAL``, the fence itself only in its log) or an error it cannot recover from.
    The pod stands down as for a fence: a rejoin is always safe, while taking the partition over
    anew could fence the partition's new owner."""


class BrokerWaitExpired(TransactionError):
    """A broker wait outlived its deadline: the producer is abandoned (a failure of the world)."""


def translate(exc: BaseException) -> BaseException:
    """librdkafka's exception as aiokafka's class for the same broker code, so one vocabulary
    (:mod:`failures`, the fence) serves both clients."""
    if not isinstance(exc, KafkaException) or not exc.args or not isinstance(exc.args[0], KafkaError):
        return exc
    return as_aiokafka(exc.args[0])


def as_aiokafka(error: KafkaError, where: str = "") -> BaseException:
    """``where``: the failed record's topic and partition, when a delivery report named them."""
    code = error.code()
    message = f"{where}: {error.str()}" if where else f"{error.name()}: {error.str()}"
    translated: BaseException
    if code in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
        translated = ProducerFenced(message)
    elif code == KafkaError._FATAL or error.fatal():
        translated = FatalProducer(message)
    elif code in _LOCAL_RECORD_CODES or code in _BROKER_RECORD_CODES:
        translated = RecordRefused(message)
    elif code > 0:  # the broker's code: aiokafka's class for it (MessageSizeTooLargeError, ...)
        translated = for_code(code)(message)
    else:
        translated = TransactionError(message)
    return translated


def named(message: Any) -> str:
    """A failed record in words: its topic, partition (when assigned) and key."""
    topic, partition = message.topic(), message.partition()
    where = f"{topic} [{partition}]" if partition is not None and partition >= 0 else str(topic)
    key = message.key()
    if key is not None:
        text = bytes(key[:64]).decode("utf-8", "replace")
        where += f" key {text!r}{'...' if len(key) > 64 else ''}"
    return where


__all__ = [
    "PURGED_CODES",
    "BrokerWaitExpired",
    "FatalProducer",
    "RecordRefused",
    "TransactionError",
    "as_aiokafka",
    "named",
    "translate",
]
