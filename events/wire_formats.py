"""How real producers lay an event out in a Kafka record, read (and written) without I/O.

* The Confluent Schema Registry wire format (``KafkaProtobufSerializer``, confluent-kafka's
  ``ProtobufSerializer``): magic byte ``0x00``, the schema id as a big-endian int32, the
  message-index path (a zigzag-varint count then the indexes, the first message of the file
  ``[0]`` written as the single byte ``0x00``), then the protobuf bytes. A protobuf message never
  starts with ``0x00`` (field number 0 does not exist), so a framed value is told from a bare one
  by its first byte alone.
* CloudEvents structured mode (``application/cloudevents+json``): the whole event is a JSON object
  in the value, the data in ``data_base64`` (bytes) or ``data`` (JSON).

Nothing here decides whether a record is acceptable: :mod:`events.codec` does, with these.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from typing import Final, NamedTuple

#: The Confluent wire format's magic byte (``0x01`` is the newer 16-byte GUID form: refused, named).
MAGIC_BYTE: Final = 0
MAGIC_BYTE_GUID: Final = 1
#: The header some serializers (confluent-kafka-python's ``serde.py``) put the schema id in.
VALUE_SCHEMA_ID_HEADER: Final = "__value_schema_id"
STRUCTURED_CONTENT_TYPE: Final = "application/cloudevents+json"
JSON_CONTENT_TYPES: Final = frozenset({"application/json", "text/json"})
#: The most message indexes a path may have (nesting depth): a longer one is corrupt, not read on.
MAX_INDEX_DEPTH: Final = 32


class WireFormatError(ValueError):
    """The value claims a format and breaks it; the message is the dead letter's reason."""


class Framing(NamedTuple):
    """What the Schema Registry framing said: which schema, which message of it, where the bytes start."""

    schema_id: int
    indexes: tuple[int, ...]
    payload_offset: int

    def describe(self) -> str:
        return f"schema id {self.schema_id}, message index {list(self.indexes)}"


def is_framed(value: bytes | None) -> bool:
    """A Schema Registry framed value (or the GUID form), by its first byte."""
    return bool(value) and value is not None and value[0] in (MAGIC_BYTE, MAGIC_BYTE_GUID)


def _read_varint(value: bytes, at: int) -> tuple[int, int]:
    """An unsigned LEB128 varint of at most 5 bytes (an int32, as Kafka's ``ByteUtils``)."""
    result = 0
    for i in range(5):
        if at >= len(value):
            raise WireFormatError("Schema Registry framing: message index truncated")
        byte = value[at]
        at += 1
        result |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return result, at
    raise WireFormatError("Schema Registry framing: message index varint longer than 5 bytes")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _read_zigzag(value: bytes, at: int) -> tuple[int, int]:
    raw, at = _read_varint(value, at)
    return _zigzag(raw), at


def read_framing(value: bytes) -> Framing:
    """The framing of a value whose first byte is a magic byte, or :class:`WireFormatError`."""
    if value[0] == MAGIC_BYTE_GUID:
        raise WireFormatError(
            "Schema Registry framing with a schema GUID (magic byte 1) is not read: "
            "configure the producer to write the schema id (magic byte 0)"
        )
    if len(value) < 6:
        raise WireFormatError(f"Schema Registry framing: {len(value)} bytes, shorter than its 6-byte header")
    (schema_id,) = struct.unpack_from(">i", value, 1)
    count, at = _read_zigzag(value, 5)
    if count == 0:
        return Framing(schema_id, (0,), at)  # the one-byte form of [0]
    if count < 0 or count > MAX_INDEX_DEPTH:
        # An old confluent-kafka-python (< 1.8, ``use.deprecated.format``) wrote the count without
        # zigzag: [0] as 0x01 0x00 reads as a count of -1.
        raise WireFormatError(
            f"Schema Registry framing: message index count {count} (an old producer's "
            "use.deprecated.format writes indexes without zigzag encoding; it is not read)"
        )
    indexes = []
    for _ in range(count):
        index, at = _read_zigzag(value, at)
        if index < 0:
            raise WireFormatError(f"Schema Registry framing: negative message index {index}")
        indexes.append(index)
    return Framing(schema_id, tuple(indexes), at)


def _write_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _write_zigzag(n: int) -> bytes:
    return _write_varint((n << 1) ^ (n >> 31))


def write_framing(schema_id: int, indexes: tuple[int, ...], payload: bytes) -> bytes:
    """The value ``KafkaProtobufSerializer`` writes: ``[0]`` as one byte, any other path in full."""
    if indexes == (0,):
        path = b"\x00"
    else:
        path = _write_zigzag(len(indexes)) + b"".join(_write_zigzag(i) for i in indexes)
    return struct.pack(">bi", MAGIC_BYTE, schema_id) + path + payload


def media_type(content_type: str | None) -> str:
    """``application/json; charset=utf-8`` -> ``application/json``."""
    return (content_type or "").split(";", 1)[0].strip().lower()


class StructuredEvent(NamedTuple):
    """A CloudEvents structured-mode event: its attributes, and its data as bytes with their type."""

    ce_type: str
    ce_id: str
    data: bytes | None
    data_content_type: str


def read_structured(value: bytes | None) -> StructuredEvent:
    """A CloudEvents structured-mode value (``application/cloudevents+json``), or :class:`WireFormatError`."""
    if value is None:
        raise WireFormatError("empty payload (tombstone) where a structured CloudEvent was expected")
    try:
        event = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"structured CloudEvent is not JSON: {exc}") from None
    if not isinstance(event, dict):
        raise WireFormatError("structured CloudEvent is not a JSON object")
    ce_type = event.get("type")
    if not isinstance(ce_type, str) or not ce_type:
        raise WireFormatError("structured CloudEvent without a 'type'")
    ce_id = event.get("id")
    content_type = event.get("datacontenttype")
    data: bytes | None
    if "data_base64" in event:
        encoded = event["data_base64"]
        if not isinstance(encoded, str):
            raise WireFormatError("structured CloudEvent's data_base64 is not a string")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireFormatError(f"structured CloudEvent's data_base64 is not base64: {exc}") from None
        default_type = "application/protobuf"
    elif "data" in event:
        body = event["data"]
        # JSON data is the event's JSON; a string under a non-JSON type is that text's bytes.
        if isinstance(body, str) and content_type and media_type(content_type) not in JSON_CONTENT_TYPES:
            data = body.encode()
        else:
            data = json.dumps(body).encode()
        default_type = "application/json"
    else:
        data = None
        default_type = ""
    return StructuredEvent(
        ce_type,
        ce_id if isinstance(ce_id, str) else "",
        data,
        content_type if isinstance(content_type, str) and content_type else default_type,
    )
