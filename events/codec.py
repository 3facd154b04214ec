"""Kafka record ⇄ protobuf event codec.

The event type travels in CloudEvents-style headers (``ce_type``, ``ce_id``,
``ce_source``, ``ce_time``, ``ce_specversion``), the payload is the binary
protobuf, the key is the execution id (session id for session events).
Decoding is strict: anything the pod cannot trust raises :class:`DecodeError`
with a reason that the dead-letter record carries.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2

SCHEMA_VERSION: Final = 1
CE_SPECVERSION: Final = "1.0"
CONTENT_TYPE: Final = "application/protobuf"
TYPE_PREFIX: Final = "sandbox_lanes.v1."
#: Payloads above this size are refused (dead-lettered), not parsed.
MAX_PAYLOAD_BYTES: Final = 1 << 20

InputEvent: TypeAlias = inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted
OutcomeEvent: TypeAlias = (
    outcomes_pb2.SandboxProvisioned
    | outcomes_pb2.SandboxFailed
    | outcomes_pb2.SandboxDeprovisioned
    | outcomes_pb2.SandboxTeardownFailed
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
    )
}
STATE_TYPE: Final = TYPE_PREFIX + state_pb2.ExecutionState.DESCRIPTOR.name
ALL_TYPES: Final[dict[str, type[Message]]] = {
    **INPUT_TYPES,
    **OUTCOME_TYPES,
    STATE_TYPE: state_pb2.ExecutionState,
}

#: Output ids are uuid5 over (input event id, outcome type, scope): a redelivered
#: input re-derives the same id, so consumers can de-duplicate at-least-once output.
_OUTPUT_ID_NAMESPACE: Final = uuid.UUID("6f1d3c2e-5b7a-4e0b-9a51-2f4c8d7e9b10")


class DecodeError(ValueError):
    """A record the pod cannot process; ``reason`` goes to the dead-letter header."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class EncodedRecord:
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def type_name(message: Message) -> str:
    return TYPE_PREFIX + message.DESCRIPTOR.name


def derived_event_id(causation_id: str, kind: str, discriminator: str = "") -> str:
    return str(uuid.uuid5(_OUTPUT_ID_NAMESPACE, f"{causation_id}/{kind}/{discriminator}"))


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


def record_key(message: Message) -> str:
    """The Kafka key of an event: its execution id, or the session id for session events."""
    if isinstance(message, inputs_pb2.SessionDeleted):
        return message.session_id
    key: str = getattr(message, "execution_id")  # noqa: B009 - every other event has one
    if not key and message.DESCRIPTOR.fields_by_name.get("sandbox") is not None:
        # A session-sandbox teardown has no execution: key it by the session id.
        sandbox_id: str = getattr(message, "sandbox").sandbox_id  # noqa: B009
        return sandbox_id
    return key


def encode(message: Message, *, source: str = "sandbox-lanes") -> EncodedRecord:
    """Serialize an event (or a state value) with its CloudEvents headers."""
    ce_type = type_name(message)
    if ce_type not in ALL_TYPES:
        raise ValueError(f"not a sandbox-lanes event: {ce_type}")
    meta = getattr(message, "meta", None)
    event_id = meta.event_id if meta is not None else ""
    occurred = meta.occurred_at.ToJsonString() if meta is not None and meta.HasField("occurred_at") else ""
    key = message.execution_id if isinstance(message, state_pb2.ExecutionState) else record_key(message)
    headers = [
        ("ce_specversion", CE_SPECVERSION.encode()),
        ("ce_type", ce_type.encode()),
        ("ce_id", event_id.encode()),
        ("ce_source", (meta.source if meta is not None and meta.source else source).encode()),
        ("ce_time", occurred.encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]
    return EncodedRecord(key=key.encode(), value=message.SerializeToString(), headers=headers)


def header(headers: Iterable[tuple[str, bytes]] | None, name: str) -> str | None:
    for k, v in headers or ():
        if k == name:
            return v.decode("utf-8", errors="replace") if v is not None else ""
    return None


def _check_enums(message: Message, descriptor: Descriptor, path: str = "") -> None:
    """Proto3 enums are open: an unknown number parses; the pod refuses it explicitly."""
    for field in descriptor.fields:
        name = f"{path}{field.name}"
        if field.type == FieldDescriptor.TYPE_ENUM:
            enum: EnumDescriptor | None = field.enum_type
            assert enum is not None
            values = getattr(message, field.name)
            for value in values if field.is_repeated else [values]:
                if value not in enum.values_by_number:
                    raise DecodeError(f"unknown enum value {value} for field {name} ({enum.full_name})")
        elif (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and not field.is_repeated
            and field.message_type is not None
            and message.HasField(field.name)
        ):
            _check_enums(getattr(message, field.name), field.message_type, f"{name}.")


def decode(
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes]] | None,
    *,
    allowed: dict[str, type[Message]] = INPUT_TYPES,
) -> Message:
    """Decode one record, or raise :class:`DecodeError` naming what is wrong."""
    ce_type = header(headers, "ce_type")
    if ce_type is None or ce_type == "":
        raise DecodeError("missing ce_type header")
    cls = allowed.get(ce_type)
    if cls is None:
        raise DecodeError(f"unknown event type '{ce_type}'")
    if value is None:
        raise DecodeError("empty payload (tombstone) where an event was expected")
    if len(value) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"payload of {len(value)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
    message = cls()
    try:
        message.ParseFromString(value)
    except (ProtobufDecodeError, RuntimeError, ValueError) as exc:
        raise DecodeError(f"payload does not decode as {ce_type}: {exc}") from exc
    descriptor: Descriptor = message.DESCRIPTOR  # type: ignore[assignment]  # upb's Descriptor is the same API
    _check_enums(message, descriptor)
    if ce_type in INPUT_TYPES:
        _validate_input(message, key)
    return message


def _validate_input(message: Message, key: bytes | None) -> None:
    meta: common_pb2.EventMeta = getattr(message, "meta")  # noqa: B009
    if not message.HasField("meta") or not meta.event_id:
        raise DecodeError("missing meta.event_id")
    if meta.schema_version > SCHEMA_VERSION:
        raise DecodeError(
            f"unsupported schema_version {meta.schema_version} (this pod reads {SCHEMA_VERSION})"
        )
    record = record_key(message)
    if not record:
        field = "session_id" if isinstance(message, inputs_pb2.SessionDeleted) else "execution_id"
        raise DecodeError(f"missing {field}")
    if key is None or key == b"":
        raise DecodeError("missing record key")
    if key.decode("utf-8", errors="replace") != record:
        raise DecodeError(f"record key '{key.decode('utf-8', errors='replace')}' does not match '{record}'")
    if isinstance(message, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged) and (
        message.kind == common_pb2.EXECUTION_KIND_UNSPECIFIED
    ):
        raise DecodeError("missing kind (AGENT_EXECUTION or WORKFLOW_EXECUTION)")


def decode_input(
    key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes]] | None
) -> InputEvent:
    """:func:`decode` restricted to the input events, typed as such."""
    message = decode(key, value, headers, allowed=INPUT_TYPES)
    assert isinstance(
        message, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted
    )
    return message


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
