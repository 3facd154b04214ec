"""Operator tools over the topics: publish events from a file, print decoded events."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from google.protobuf.message import Message

from consumers.runtime.kafka.codecs import require_codecs
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topology import Topics
from events import schema_registry
from events.codec import (
    ALL_TYPES,
    INPUT_TYPES,
    TYPE_PREFIX,
    DecodeError,
    decode,
    encode,
    from_dict,
    header,
    to_json,
    wire_format,
)
from events.sandbox_lanes.v1 import inputs_pb2


def topic_for(message: Message, topics: Topics) -> str:
    if isinstance(message, inputs_pb2.ExecutionCreated):
        return topics.execution_created
    if isinstance(message, inputs_pb2.PhaseChanged):
        return topics.phase_changed
    if isinstance(message, inputs_pb2.SessionDeleted):
        return topics.session_deleted
    raise ValueError(f"{type(message).__name__} is not an input event")


class InputFileError(ValueError):
    """An events file that cannot be read; the message names the file and the event."""


def load_events(path: Path) -> list[Message]:
    """Read ``[{type: ExecutionCreated, ...fields}]`` (or ``{events: [...]}``) from JSON or YAML."""
    try:
        raw: Any = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    except (OSError, yaml.YAMLError) as exc:
        raise InputFileError(f"{path}: {exc}") from exc
    items = raw.get("events", raw) if isinstance(raw, dict) else raw
    if not isinstance(items, list):
        raise InputFileError(f"{path}: expected a list of events or a mapping with 'events'")
    messages: list[Message] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or "type" not in item:
            raise InputFileError(f"{path}: event #{index} needs a 'type' ({', '.join(_input_names())})")
        data = {k: v for k, v in item.items() if k != "type"}
        meta = dict(data.get("meta") or {})
        meta.setdefault("event_id", f"{path.stem}-{index}")
        meta.setdefault("occurred_at", dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"))
        meta.setdefault("schema_version", 1)
        data["meta"] = meta
        try:
            messages.append(from_dict(str(item["type"]), data))
        except Exception as exc:
            raise InputFileError(f"{path}: event #{index}: {exc}") from exc
    return messages


def _input_names() -> Iterable[str]:
    return (name.removeprefix(TYPE_PREFIX) for name in INPUT_TYPES)


async def produce(
    bootstrap: str,
    messages: list[Message],
    topics: Topics,
    *,
    source: str = "sandbox-lanes-cli",
    security: KafkaSecurity = PLAINTEXT,
) -> int:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=0, **security.client_options()
    )
    await producer.start()
    try:
        for message in messages:
            record = encode(message, source=source)
            # One record per request: correct on every broker, Tansu included.
            await producer.send_and_wait(
                topic_for(message, topics), record.value, key=record.key, headers=record.headers
            )
    finally:
        await producer.stop()
    return len(messages)


def describe(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Any,
    offset: int,
    partition: int,
    *,
    carries: str | None = None,
) -> dict[str, Any]:
    """One record as a JSON-able entry; ``carries``: the one type an input topic carries (a record
    without ``ce_type`` is read as it, as the pod reads it)."""
    ce_type = header(headers, "ce_type") or carries or ""
    entry: dict[str, Any] = {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": key.decode("utf-8", errors="replace") if key else None,
        "type": ce_type.removeprefix(TYPE_PREFIX),
    }
    reason = header(headers, "dlq_reason")
    if reason is not None:
        entry["dlq_reason"] = reason
        return entry
    entry["format"] = wire_format(value, headers)
    try:
        event = decode(key, value, headers, allowed=ALL_TYPES, topic_carries=carries)
        entry["type"] = event.DESCRIPTOR.name
        entry["event"] = json.loads(to_json(event))
    except DecodeError as exc:
        entry["error"] = exc.reason
    return entry


async def tail(
    bootstrap: str,
    topic_names: list[str],
    *,
    out: TextIO = sys.stdout,
    from_beginning: bool = True,
    idle_timeout_s: float | None = 5.0,
    max_records: int | None = None,
    isolation_level: str = "read_uncommitted",
    security: KafkaSecurity = PLAINTEXT,
    topics: Topics | None = None,
) -> int:
    """Print decoded records as JSON lines; stop after ``idle_timeout_s`` without records (None = follow).

    With ``topics``, an input topic's record without ``ce_type`` is read as the type it carries.
    """
    require_codecs()  # every codec a producer may use, or an error naming the missing one
    consumer = AIOKafkaConsumer(
        *topic_names,
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        isolation_level=isolation_level,
        **security.client_options(),
    )
    printed = 0
    loop = asyncio.get_running_loop()
    last = loop.time()
    try:
        await consumer.start()  # a failed start is stopped too (no 'Unclosed AIOKafkaConsumer')
        while max_records is None or printed < max_records:
            batch = await consumer.getmany(timeout_ms=500)
            if not batch:
                if idle_timeout_s is not None and loop.time() - last > idle_timeout_s:
                    break
                continue
            last = loop.time()
            for tp, records in batch.items():
                for rec in records:
                    await schema_registry.ensure(rec.value)
                    carries = topics.carries(tp.topic) if topics is not None else None
                    line = describe(
                        tp.topic, rec.key, rec.value, rec.headers, rec.offset, tp.partition, carries=carries
                    )
                    print(json.dumps(line, sort_keys=False), file=out, flush=True)
                    printed += 1
    finally:
        await consumer.stop()
    return printed
