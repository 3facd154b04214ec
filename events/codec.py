"""Kafka record ⇄ protobuf event codec.

The event type travels in CloudEvents-style headers (``ce_type``, ``ce_id``,
``ce_source``, ``ce_time``, ``ce_specversion``), the payload is the binary
protobuf, the key is the execution id (session id for session events).
Decoding is strict: anything the pod cannot trust raises :class:`DecodeError`
with a reason that the dead-letter record carries.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple, TypeAlias

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from events import schema_registry
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from events.wire_formats import (
    JSON_CONTENT_TYPES,
    STRUCTURED_CONTENT_TYPE,
    Framing,
    WireFormatError,
    is_framed,
    media_type,
    read_framing,
    read_structured,
    write_framing,
)

SCHEMA_VERSION: Final = 1
CE_SPECVERSION: Final = "1.0"
CONTENT_TYPE: Final = "application/protobuf"
TYPE_PREFIX: Final = "sandbox_lanes.v1."
#: Payloads above this size are refused (dead-lettered), not parsed.
MAX_PAYLOAD_BYTES: Final = 1 << 20
#: An input event's payload limit. The state, effects and outcomes an input produces
#: repeat its fields (an execution id up to 7 times), so an input of at most 64 KiB keeps every
#: record derived from it under the producer's 1 MiB request limit; the pod also checks each
#: derived record's size before it sends it (``consumers.runtime.record_limits``).
MAX_INPUT_BYTES: Final = 64 * 1024
#: protobuf's ``Timestamp`` range: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999999Z.
TIMESTAMP_MIN_SECONDS: Final = -62_135_596_800
TIMESTAMP_MAX_SECONDS: Final = 253_402_300_799

InputEvent: TypeAlias = inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted
#: The capacity ledger's answers to an execution's partition (docs/guarantees.md "Capacity"): decided
#: by the rules like an input, but written by the pod itself, on the admissions topic.
CapacityAnswer: TypeAlias = (
    capacity_pb2.CapacityQueued | capacity_pb2.CapacityAdmitted | capacity_pb2.CapacityTimedOut
)
#: What the rules decide: an upstream input or a capacity answer.
DecidedEvent: TypeAlias = InputEvent | CapacityAnswer
#: The capacity log's records (one partition): requests and releases from the execution partitions,
#: the ledger owner's ticks.
CapacityRecord: TypeAlias = (
    capacity_pb2.CapacityRequested | capacity_pb2.CapacityReleased | capacity_pb2.CapacityTick
)
OutcomeEvent: TypeAlias = (
    outcomes_pb2.SandboxProvisioned
    | outcomes_pb2.SandboxFailed
    | outcomes_pb2.SandboxDeprovisioned
    | outcomes_pb2.SandboxTeardownFailed
    | outcomes_pb2.SandboxReaped
    | outcomes_pb2.SandboxQueued
)
Headers: TypeAlias = Sequence[tuple[str, bytes]]

INPUT_TYPES: Final[dict[str, type[Message]]] = {
    TYPE_PREFIX + cls.DESCRIPTOR.name: cls
    for cls in (inputs_pb2.ExecutionCreated, inputs_pb2.PhaseChanged, inputs_pb2.SessionDeleted)
}
OUTCOME_TYPES: Final[dict[str, type[Message]]] = {
    TYPE_PREFIX + cls.DESCRIPTOR.name: cls
    for cls in (
        outcomes_pb2.SandboxProvisioned,
        outcomes_pb2.SandboxFailed,
        outcomes_pb2.SandboxDeprovisioned,
        outcomes_pb2.SandboxTeardownFailed,
        outcomes_pb2.SandboxReaped,
        outcomes_pb2.SandboxQueued,
    )
}
CAPACITY_ANSWER_TYPES: Final[dict[str, type[Message]]] = {
    TYPE_PREFIX + cls.DESCRIPTOR.name: cls
    for cls in (capacity_pb2.CapacityQueued, capacity_pb2.CapacityAdmitted, capacity_pb2.CapacityTimedOut)
}
CAPACITY_LOG_TYPES: Final[dict[str, type[Message]]] = {
    TYPE_PREFIX + cls.DESCRIPTOR.name: cls
    for cls in (capacity_pb2.CapacityRequested, capacity_pb2.CapacityReleased, capacity_pb2.CapacityTick)
}
STATE_TYPE: Final = TYPE_PREFIX + state_pb2.ExecutionState.DESCRIPTOR.name
ALL_TYPES: Final[dict[str, type[Message]]] = {
    **INPUT_TYPES,
    **OUTCOME_TYPES,
    **CAPACITY_ANSWER_TYPES,
    **CAPACITY_LOG_TYPES,
    STATE_TYPE: state_pb2.ExecutionState,
}

#: Output ids are uuid5 over (input event id, outcome type, scope): a redelivered
#: input re-derives the same id, so consumers can de-duplicate at-least-once output.
_OUTPUT_ID_NAMESPACE: Final = uuid.UUID("6f1d3c2e-5b7a-4e0b-9a51-2f4c8d7e9b10")
_OUTPUT_ID_NAMESPACE_BYTES: Final = _OUTPUT_ID_NAMESPACE.bytes


class DecodeError(ValueError):
    """A record the pod cannot process; ``reason`` goes to the dead-letter header."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EncodedRecord(NamedTuple):
    """Immutable and compared by value; a NamedTuple because two are built per input record."""

    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def type_name(message: Message) -> str:
    return TYPE_PREFIX + message.DESCRIPTOR.name


#: The RFC 4122 variant applied to the high nibble of byte 8 (``(b & 0x3F) | 0x80``), as hex.
_VARIANT_NIBBLE: Final = {f"{n:x}": "89ab"[n & 3] for n in range(16)}


def derived_event_id(causation_id: str, kind: str, discriminator: str = "") -> str:
    """``str(uuid.uuid5(namespace, name))``, computed without building ``UUID`` objects (hot path).

    The version (5) and variant bits are set on the hex digits directly.
    """
    name = f"{causation_id}/{kind}/{discriminator}".encode()
    h = hashlib.sha1(_OUTPUT_ID_NAMESPACE_BYTES + name).hexdigest()
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT_NIBBLE[h[16]]}{h[17:20]}-{h[20:32]}"


def new_event_id() -> str:
    return str(uuid.uuid4())


def timestamp(at: dt.datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(at.astimezone(dt.UTC))
    return ts


def new_meta(
    *,
    event_id: str | None = None,
    occurred_at: dt.datetime | None = None,
    source: str = "",
    causation_id: str = "",
) -> common_pb2.EventMeta:
    return common_pb2.EventMeta(
        event_id=event_id or new_event_id(),
        occurred_at=timestamp(occurred_at or dt.datetime.now(dt.UTC)),
        schema_version=SCHEMA_VERSION,
        source=source,
        causation_id=causation_id,
    )


def state_key(message: Message) -> str:
    """The key of the state an event is applied to: its execution id, or the session id for
    session events (``SessionDeleted``, a session-sandbox teardown's outcome)."""
    if isinstance(message, inputs_pb2.SessionDeleted):
        return message.session_id
    key: str = getattr(message, "execution_id")  # noqa: B009 - every other event has one
    if not key and message.DESCRIPTOR.fields_by_name.get("sandbox") is not None:
        # A session-sandbox teardown has no execution: key it by the session id.
        sandbox_id: str = getattr(message, "sandbox").sandbox_id  # noqa: B009
        return sandbox_id
    return key


def record_key(message: Message) -> str:
    """The Kafka key of an event: :func:`state_key`, except that an agent execution's inputs are
    keyed by its session id (when it has one), so a session's creates and its delete share one
    partition number and are applied in order (the session lane reads the session's record)."""
    if isinstance(message, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged):
        if message.kind == common_pb2.AGENT_EXECUTION and message.session_id:
            return message.session_id
        return message.execution_id
    if isinstance(message, capacity_pb2.CapacityRequested | capacity_pb2.CapacityReleased):
        return message.sandbox_key  # the capacity log: keyed by what is counted
    if isinstance(message, capacity_pb2.CapacityTick):
        return CAPACITY_TICK_KEY
    return state_key(message)


#: The capacity log's key of the ledger owner's ticks.
CAPACITY_TICK_KEY: Final = "tick"


_CE_SPECVERSION_BYTES: Final = CE_SPECVERSION.encode()
_CONTENT_TYPE_BYTES: Final = CONTENT_TYPE.encode()
_CE_TYPE_BYTES: Final[dict[str, bytes]] = {name: name.encode() for name in ALL_TYPES}

#: ``Timestamp.ToJsonString()`` of whole seconds, without the ``Z`` (the date part is the slow part).
_SECONDS_TEXT: dict[int, str] = {}
_SECONDS_TEXT_MAX: Final = 4096


def timestamp_json(ts: timestamp_pb2.Timestamp) -> str:
    """``ts.ToJsonString()``, byte for byte, with the whole-seconds text cached (hot path: ``ce_time``)."""
    seconds = ts.seconds
    nanos = ts.nanos
    head = _SECONDS_TEXT.get(seconds)
    if head is None:
        head = timestamp_pb2.Timestamp(seconds=seconds).ToJsonString()[:-1]  # raises on invalid seconds
        if len(_SECONDS_TEXT) >= _SECONDS_TEXT_MAX:
            _SECONDS_TEXT.clear()
        _SECONDS_TEXT[seconds] = head
    # The fraction exactly as protobuf's well_known_types.Timestamp.ToJsonString writes it.
    if nanos < 0 or nanos >= 1_000_000_000:
        return ts.ToJsonString()  # raises protobuf's own "Timestamp is not valid" error
    # (nanos is an int in [0, 1e9): protobuf's "%03d" % (nanos / 1e6) is nanos // 1_000_000.)
    if nanos == 0:
        return head + "Z"
    if nanos % 1_000_000 == 0:
        return f"{head}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{head}.{nanos // 1_000:06d}Z"
    return f"{head}.{nanos:09d}Z"


def encode(message: Message, *, source: str = "sandbox-lanes") -> EncodedRecord:
    """Serialize an event (or a state value) with its CloudEvents headers."""
    ce_type = type_name(message)
    ce_type_bytes = _CE_TYPE_BYTES.get(ce_type)
    if ce_type_bytes is None:
        raise ValueError(f"not a sandbox-lanes event: {ce_type}")
    meta = getattr(message, "meta", None)
    if meta is not None:
        event_id = meta.event_id
        occurred = timestamp_json(meta.occurred_at) if meta.HasField("occurred_at") else ""
        meta_source = meta.source
        if meta_source:
            source = meta_source
    else:
        event_id = occurred = ""
    key = message.execution_id if isinstance(message, state_pb2.ExecutionState) else record_key(message)
    value = message.SerializeToString()
    if _OUTPUT_SCHEMA_ID is not None and ce_type in OUTCOME_TYPES:
        value = write_framing(_OUTPUT_SCHEMA_ID, file_index(type(message)), value)
    headers = [
        ("ce_specversion", _CE_SPECVERSION_BYTES),
        ("ce_type", ce_type_bytes),
        ("ce_id", event_id.encode()),
        ("ce_source", source.encode()),
        ("ce_time", occurred.encode()),
        ("content-type", _CONTENT_TYPE_BYTES),
    ]
    return EncodedRecord(key.encode(), value, headers)


#: The schema id outcomes are framed with (``SANDBOX_LANES_OUTPUT_FORMAT=schema-registry``), or None.
_OUTPUT_SCHEMA_ID: int | None = None


def frame_outcomes(schema_id: int | None) -> None:
    """Frame every outcome :func:`encode` writes with ``schema_id`` (None: the project's own format)."""
    global _OUTPUT_SCHEMA_ID
    _OUTPUT_SCHEMA_ID = schema_id


def header(headers: Iterable[tuple[str, bytes]] | None, name: str) -> str | None:
    for k, v in headers or ():
        if k == name:
            return v.decode("utf-8", errors="replace") if v is not None else ""
    return None


#: One step of an enum check: (field name, path name, known numbers or None for a sub-message,
#: enum full name, repeated, sub-message descriptor).
_EnumStep: TypeAlias = tuple[str, str, frozenset[int] | None, str, bool, Descriptor | None]
_ENUM_PLANS: dict[tuple[str, str], tuple[_EnumStep, ...]] = {}


def _enum_plan(
    descriptor: Descriptor, path: str, visiting: frozenset[str] = frozenset()
) -> tuple[_EnumStep, ...]:
    """The fields :func:`_check_enums` visits, in descriptor order, computed once per (type, path).

    Sub-messages whose whole tree has no enum field are left out: checking them cannot fail. A
    recursive type is kept as a step and planned when a value actually nests it.
    """
    cache_key = (descriptor.full_name, path)
    plan = _ENUM_PLANS.get(cache_key)
    if plan is not None:
        return plan
    visiting = visiting | {descriptor.full_name}
    steps: list[_EnumStep] = []
    for field in descriptor.fields:
        name = f"{path}{field.name}"
        if field.type == FieldDescriptor.TYPE_ENUM:
            enum: EnumDescriptor | None = field.enum_type
            assert enum is not None
            numbers = frozenset(enum.values_by_number)
            steps.append((field.name, name, numbers, enum.full_name, field.is_repeated, None))
        elif (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and not field.is_repeated
            and field.message_type is not None
            and (
                field.message_type.full_name in visiting
                or _enum_plan(field.message_type, f"{name}.", visiting)
            )
        ):
            steps.append((field.name, name, None, "", False, field.message_type))
    plan = tuple(steps)
    _ENUM_PLANS[cache_key] = plan
    return plan


def _check_enums(message: Message, descriptor: Descriptor, path: str = "") -> None:
    """Proto3 enums are open: an unknown number parses; the pod refuses it explicitly."""
    for field_name, name, numbers, enum_name, repeated, sub in _enum_plan(descriptor, path):
        if numbers is not None:
            values = getattr(message, field_name)
            for value in values if repeated else (values,):
                if value not in numbers:
                    raise DecodeError(f"unknown enum value {value} for field {name} ({enum_name})")
        elif message.HasField(field_name):
            assert sub is not None
            _check_enums(getattr(message, field_name), sub, f"{name}.")


def decode(
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes]] | None,
    *,
    allowed: dict[str, type[Message]] = INPUT_TYPES,
    record_time_ms: int | None = None,
    max_ahead_s: float | None = None,
    topic_carries: str | None = None,
) -> Message:
    """Decode one record, or raise :class:`DecodeError` naming what is wrong.

    With ``max_ahead_s``, an input whose ``occurred_at`` is more than that ahead of
    ``record_time_ms`` (the record's timestamp) is refused. With ``topic_carries`` (the one
    ``ce_type`` the record's topic carries), a record of another type is refused before its
    payload is read: a ``PhaseChanged`` labelled ``SessionDeleted`` would otherwise decode (protobuf
    skips the fields it does not know) and end a live execution's session.
    """
    ce_type = header(headers, "ce_type")
    content_type = media_type(header(headers, "content-type"))
    if content_type == STRUCTURED_CONTENT_TYPE:
        try:
            structured = read_structured(value)
        except WireFormatError as exc:
            raise DecodeError(str(exc)) from None
        ce_type, value, content_type = (
            structured.ce_type,
            structured.data,
            media_type(structured.data_content_type),
        )
    if ce_type is None or ce_type == "":
        if topic_carries is None:
            raise DecodeError("missing ce_type header")
        ce_type = topic_carries  # the topic says the type (a producer writing its protobuf class as is)
    cls = allowed.get(ce_type)
    if cls is None:
        raise DecodeError(f"unknown event type '{ce_type}'")
    if topic_carries is not None and ce_type != topic_carries:
        raise DecodeError(f"event type '{ce_type}' on a topic that carries '{topic_carries}' only")
    if value is None:
        raise DecodeError("empty payload (tombstone) where an event was expected")
    limit = MAX_INPUT_BYTES if ce_type in INPUT_TYPES else MAX_PAYLOAD_BYTES
    if len(value) > limit:
        raise DecodeError(f"payload of {len(value)} bytes exceeds the {limit}-byte limit")
    message = cls()
    if content_type in JSON_CONTENT_TYPES:
        _parse_json(message, value, ce_type)
    else:
        if is_framed(value):
            value = value[_check_framing(value, cls).payload_offset :]
        try:
            message.ParseFromString(value)
        except (ProtobufDecodeError, RuntimeError, ValueError) as exc:
            raise DecodeError(f"payload does not decode as {ce_type}: {exc}") from exc
    descriptor: Descriptor = message.DESCRIPTOR  # type: ignore[assignment]  # upb's Descriptor is the same API
    _check_enums(message, descriptor)
    _check_timestamps(message, descriptor)
    if ce_type in INPUT_TYPES:
        _validate_input(message, key, record_time_ms, max_ahead_s)
    return message


def _parse_json(message: Message, value: bytes, ce_type: str) -> None:
    """The canonical protobuf JSON mapping (``toJson``, ``JsonFormat``, ``json_format``); fields this
    pod does not know are skipped, as the binary form skips them."""
    from google.protobuf import json_format

    try:
        json_format.Parse(value, message, ignore_unknown_fields=True)
    except (json_format.ParseError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise DecodeError(f"payload does not decode as {ce_type} (protobuf JSON): {exc}") from None


def file_index(cls: type[Message]) -> tuple[int, ...]:
    """The message-index path of a message in this project's ``.proto`` file that declares it."""
    descriptor = cls.DESCRIPTOR
    names = list(descriptor.file.message_types_by_name)
    return (names.index(descriptor.name),)


def _check_framing(value: bytes, cls: type[Message]) -> Framing:
    """Read a Schema Registry framing and check it names ``cls``: by the registry's schema when one is
    configured, else by the path's place in this project's ``.proto`` file."""
    try:
        framing = read_framing(value)
    except WireFormatError as exc:
        raise DecodeError(str(exc)) from None
    expected = cls.DESCRIPTOR.full_name
    registry = schema_registry.ACTIVE
    if registry is None:
        if framing.indexes != file_index(cls):
            raise DecodeError(
                f"Schema Registry framing ({framing.describe()}) names another message than "
                f"'{TYPE_PREFIX + cls.DESCRIPTOR.name}' in {cls.DESCRIPTOR.file.name}: "
                f"on a topic that carries '{TYPE_PREFIX + cls.DESCRIPTOR.name}' only"
            )
        return framing
    known = registry.cached(framing.schema_id)
    if known is None:
        registry.want(framing.schema_id)
        raise schema_registry.SchemaNotResolved(framing.schema_id)
    try:
        name = known.message_name(framing.indexes)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    if name != expected:
        raise DecodeError(
            f"Schema Registry schema id {framing.schema_id} message index {list(framing.indexes)} is "
            f"'{name}': on a topic that carries '{expected}' only"
        )
    return framing


def wire_format(value: bytes | None, headers: Iterable[tuple[str, bytes]] | None) -> str:
    """How a record was written, in words (``explain``, ``tail``): the style and a framing's schema id."""
    content_type = media_type(header(headers, "content-type"))
    ce = "CloudEvents binary" if header(headers, "ce_type") else "no CloudEvents headers"
    if content_type == STRUCTURED_CONTENT_TYPE:
        return "CloudEvents structured"
    if content_type in JSON_CONTENT_TYPES:
        return f"protobuf JSON, {ce}"
    if is_framed(value):
        assert value is not None
        try:
            return f"Schema Registry framing ({read_framing(value).describe()}), {ce}"
        except WireFormatError as exc:
            return f"Schema Registry framing, corrupt: {exc}"
    return f"protobuf, {ce}"


_TIMESTAMP_TYPE: Final = timestamp_pb2.Timestamp.DESCRIPTOR.full_name
#: Per message type: its singular message fields, and whether each is a Timestamp.
_TIMESTAMP_PLANS: dict[str, tuple[tuple[str, bool, Descriptor], ...]] = {}


def _timestamp_plan(descriptor: Descriptor) -> tuple[tuple[str, bool, Descriptor], ...]:
    plan = _TIMESTAMP_PLANS.get(descriptor.full_name)
    if plan is None:
        plan = tuple(
            (f.name, f.message_type.full_name == _TIMESTAMP_TYPE, f.message_type)
            for f in descriptor.fields
            if f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated and f.message_type is not None
        )
        _TIMESTAMP_PLANS[descriptor.full_name] = plan
    return plan


def _check_timestamps(message: Message, descriptor: Descriptor, path: str = "") -> None:
    """Every Timestamp inside protobuf's range: its JSON form (``ce_time``) raises outside it.

    Parsing the binary form accepts any seconds and nanos, so an out-of-range value would be
    applied and then fail every record derived from it, on every retry.
    """
    for name, is_timestamp, sub in _timestamp_plan(descriptor):
        if not message.HasField(name):
            continue
        value = getattr(message, name)
        if is_timestamp:
            if not TIMESTAMP_MIN_SECONDS <= value.seconds <= TIMESTAMP_MAX_SECONDS:
                raise DecodeError(
                    f"{path}{name} seconds {value.seconds} is outside protobuf's Timestamp range "
                    f"(0001-01-01 .. 9999-12-31)"
                )
            if not 0 <= value.nanos <= 999_999_999:
                raise DecodeError(f"{path}{name} nanos {value.nanos} is outside 0 .. 999999999")
        else:
            _check_timestamps(value, sub, f"{path}{name}.")


def _validate_input(
    message: Message, key: bytes | None, record_time_ms: int | None, max_ahead_s: float | None
) -> None:
    meta: common_pb2.EventMeta = getattr(message, "meta")  # noqa: B009
    if not message.HasField("meta") or not meta.event_id:
        raise DecodeError("missing meta.event_id")
    if (
        max_ahead_s is not None
        and record_time_ms is not None
        and record_time_ms >= 0
        and meta.HasField("occurred_at")
    ):
        occurred_ms = meta.occurred_at.seconds * 1000 + meta.occurred_at.nanos // 1_000_000
        ahead_s = (occurred_ms - record_time_ms) / 1000
        if ahead_s > max_ahead_s:
            # A stored phase is ordered by occurred_at: an event from the future would make every
            # real phase change after it stale, so its execution could never be torn down.
            raise DecodeError(
                f"meta.occurred_at is {ahead_s:.0f}s ahead of the record's timestamp "
                f"(allowed: {max_ahead_s:g}s of clock skew)"
            )
    if meta.schema_version > SCHEMA_VERSION:
        raise DecodeError(
            f"unsupported schema_version {meta.schema_version} (this pod reads {SCHEMA_VERSION})"
        )
    record = record_key(message)
    state = state_key(message)
    if not state:
        field = "session_id" if isinstance(message, inputs_pb2.SessionDeleted) else "execution_id"
        raise DecodeError(f"missing {field}")
    if key is None or key == b"":
        raise DecodeError("missing record key")
    if key.decode("utf-8", errors="replace") != record:
        because = ""
        if record != state:
            because = " (an agent execution's events are keyed by its session id)"
        raise DecodeError(
            f"record key '{key.decode('utf-8', errors='replace')}' does not match '{record}'{because}"
        )
    if isinstance(message, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged) and (
        message.kind == common_pb2.EXECUTION_KIND_UNSPECIFIED
    ):
        raise DecodeError("missing kind (AGENT_EXECUTION or WORKFLOW_EXECUTION)")


def decode_input(
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes]] | None,
    *,
    record_time_ms: int | None = None,
    max_ahead_s: float | None = None,
    topic_carries: str | None = None,
) -> InputEvent:
    """:func:`decode` restricted to the input events, typed as such."""
    message = decode(
        key,
        value,
        headers,
        allowed=INPUT_TYPES,
        record_time_ms=record_time_ms,
        max_ahead_s=max_ahead_s,
        topic_carries=topic_carries,
    )
    assert isinstance(
        message, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted
    )
    return message


def decode_answer(
    key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] | None
) -> CapacityAnswer:
    """A record of the admissions topic: the capacity ledger's answer to an execution."""
    message = decode(key, value, headers, allowed=CAPACITY_ANSWER_TYPES)
    assert isinstance(
        message, capacity_pb2.CapacityQueued | capacity_pb2.CapacityAdmitted | capacity_pb2.CapacityTimedOut
    )
    if not message.meta.event_id:
        raise DecodeError("missing meta.event_id")
    if not message.execution_id:
        raise DecodeError("missing execution_id")
    return message


def decode_capacity(
    key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] | None
) -> CapacityRecord:
    """A record of the capacity log."""
    message = decode(key, value, headers, allowed=CAPACITY_LOG_TYPES)
    assert isinstance(
        message, capacity_pb2.CapacityRequested | capacity_pb2.CapacityReleased | capacity_pb2.CapacityTick
    )
    if not message.meta.event_id:
        raise DecodeError("missing meta.event_id")
    return message


#: The ``ce_type`` of a lane configuration record (``LaneConfigApplied``); not an input, an outcome
#: or a state: it lives on its own topic (:func:`lane_config_topic`).
LANE_CONFIG_TYPE: Final = TYPE_PREFIX + state_pb2.LaneConfigApplied.DESCRIPTOR.name
#: Keys that once held a configuration record on the state topic (replay and explain skip them).
LANE_CONFIG_KEY_PREFIX: Final = "lane-config/"


def lane_config_topic(state_topic: str) -> str:
    """The compacted topic of the configuration records, named after the state topic it goes with."""
    return state_topic + "-config"


def is_lane_config_key(key: str) -> bool:
    """A state-topic key of a configuration record, not an execution's state."""
    return key.startswith(LANE_CONFIG_KEY_PREFIX)


def encode_lane_config(
    applied: state_pb2.LaneConfigApplied, *, source: str = "sandbox-lanes"
) -> EncodedRecord:
    """A configuration record: keyed by its fingerprint, with the CloudEvents headers of every record."""
    occurred = timestamp_json(applied.applied_at) if applied.HasField("applied_at") else ""
    headers = [
        ("ce_specversion", _CE_SPECVERSION_BYTES),
        ("ce_type", LANE_CONFIG_TYPE.encode()),
        ("ce_id", applied.fingerprint.encode()),
        ("ce_source", source.encode()),
        ("ce_time", occurred.encode()),
        ("content-type", _CONTENT_TYPE_BYTES),
    ]
    return EncodedRecord(applied.fingerprint.encode(), applied.SerializeToString(), headers)


def decode_lane_config(
    value: bytes | None, headers: Iterable[tuple[str, bytes]] | None
) -> state_pb2.LaneConfigApplied | None:
    """A configuration record, or None for anything else (a tombstone, another type, bad bytes)."""
    if value is None or header(headers, "ce_type") != LANE_CONFIG_TYPE:
        return None
    applied = state_pb2.LaneConfigApplied()
    try:
        applied.ParseFromString(value)
    except (ProtobufDecodeError, RuntimeError, ValueError):
        return None
    return applied if applied.fingerprint else None


def decode_state(value: bytes) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState()
    state.ParseFromString(value)
    return state


def to_json(message: Message) -> str:
    from google.protobuf import json_format

    return json_format.MessageToJson(message, indent=None, preserving_proto_field_name=True)


def from_dict(ce_type: str, data: dict[str, object]) -> Message:
    """Build an event from a JSON/YAML mapping (for ``sandbox-lanes produce``)."""
    from google.protobuf import json_format

    full = ce_type if ce_type.startswith(TYPE_PREFIX) else TYPE_PREFIX + ce_type
    cls = ALL_TYPES.get(full)
    if cls is None:
        known = ", ".join(sorted(n.removeprefix(TYPE_PREFIX) for n in INPUT_TYPES))
        raise ValueError(f"unknown event type '{ce_type}' (known: {known})")
    message = cls()
    json_format.ParseDict(data, message)
    return message
