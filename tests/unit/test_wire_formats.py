"""Every way issue 43 lists of writing an input event is read by the one decode path, and what each
refuses is a dead letter naming why: a topic that says the type, the Schema Registry framing (both
message-index forms, as confluent-kafka's own ``ProtobufSerializer`` writes them), protobuf JSON and
CloudEvents structured mode."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import json_format
from google.protobuf.message import Message

from events import schema_registry
from events.codec import DecodeError, decode_input, encode, new_meta, type_name, wire_format
from events.proto_text import parse
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from events.wire_formats import WireFormatError, read_framing, write_framing

CREATED = "sandbox_lanes.v1.ExecutionCreated"
PHASE = "sandbox_lanes.v1.PhaseChanged"


def _created(execution_id: str = "wf-1") -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(), kind=common_pb2.WORKFLOW_EXECUTION, execution_id=execution_id, name="n", org="o"
    )


def _phase(execution_id: str = "wf-1") -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=common_pb2.EXECUTION_PENDING,
        new_phase=common_pb2.EXECUTION_IN_PROGRESS,
    )


@pytest.fixture(autouse=True)
def _no_registry() -> Iterator[None]:
    schema_registry.configure("")
    yield
    schema_registry.configure("")


# --- 1. a topic says the type ---------------------------------------------------------------------


def test_a_record_without_ce_type_is_read_as_its_topics_type() -> None:
    event = _created()
    decoded = decode_input(b"wf-1", event.SerializeToString(), [], topic_carries=CREATED)
    assert decoded == event


def test_without_a_topic_or_a_ce_type_the_record_is_still_refused() -> None:
    with pytest.raises(DecodeError, match="missing ce_type header"):
        decode_input(b"wf-1", _created().SerializeToString(), [])


def test_a_ce_type_that_disagrees_with_the_topic_is_refused() -> None:
    record = encode(_phase())
    with pytest.raises(DecodeError, match="on a topic that carries"):
        decode_input(record.key, record.value, record.headers, topic_carries=CREATED)


def test_a_bare_record_without_an_event_id_is_refused_with_that_reason() -> None:
    event = _created()
    event.meta.event_id = ""
    with pytest.raises(DecodeError, match=r"missing meta\.event_id"):
        decode_input(b"wf-1", event.SerializeToString(), None, topic_carries=CREATED)


# --- 2. the Schema Registry framing ---------------------------------------------------------------


def test_the_framing_in_its_one_byte_form_and_its_full_zigzag_form() -> None:
    # Written out by hand from Confluent's format: magic 0, id 7 big-endian, then the path.
    one_byte = bytes([0, 0, 0, 0, 7, 0]) + b"payload"
    assert read_framing(one_byte) == (7, (0,), 6)
    # [1]: count 1 (zigzag 2), index 1 (zigzag 2).
    full = bytes([0, 0, 0, 0, 7, 2, 2]) + b"p"
    assert read_framing(full) == (7, (1,), 7)
    # [0] in full (count 1, index 0), as some writers do; and a nested path [2, 70] (70 -> 140: 0x8c 0x01).
    assert read_framing(bytes([0, 0, 0, 1, 0, 2, 0])) == (256, (0,), 7)
    assert read_framing(bytes([0, 0, 0, 0, 1, 4, 4, 0x8C, 0x01])) == (1, (2, 70), 9)


def test_write_framing_writes_what_read_framing_reads() -> None:
    for indexes in [(0,), (1,), (2, 0), (3, 200, 1)]:
        value = write_framing(12345, indexes, b"xyz")
        framing = read_framing(value)
        assert (framing.schema_id, framing.indexes, value[framing.payload_offset :]) == (
            12345,
            indexes,
            b"xyz",
        )
    assert write_framing(1, (0,), b"")[5:] == b"\x00"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\x00\x00\x00", "shorter than its 6-byte header"),
        (b"\x00\x00\x00\x00\x01\x02", "message index truncated"),
        (b"\x00\x00\x00\x00\x01\x01\x00", "use.deprecated.format"),
        (b"\x00\x00\x00\x00\x01\xff\xff\xff\xff\xff\x01", "longer than 5 bytes"),
        (b"\x01" + bytes(16) + b"\x00", "schema GUID"),
    ],
)
def test_a_broken_framing_names_what_is_wrong(value: bytes, reason: str) -> None:
    with pytest.raises(WireFormatError, match=reason):
        read_framing(value)
    with pytest.raises(DecodeError, match=reason):
        decode_input(b"wf-1", value, [], topic_carries=CREATED)


def _serializer(client: SchemaRegistryClient, cls: type[Message]) -> ProtobufSerializer:
    return ProtobufSerializer(cls, client, {"use.deprecated.format": False})


def test_confluent_kafkas_serializer_is_read_with_and_without_ce_headers() -> None:
    """confluent-kafka's ProtobufSerializer (its in-process registry): ExecutionCreated is the file's
    first message (the one-byte path), PhaseChanged its second (the full path)."""
    client = SchemaRegistryClient.new_client({"url": "mock://wire-formats"})
    created, phase = _created(), _phase()
    created_value = _serializer(client, inputs_pb2.ExecutionCreated)(
        created, SerializationContext("execution-created", MessageField.VALUE)
    )
    phase_value = _serializer(client, inputs_pb2.PhaseChanged)(
        phase, SerializationContext("phase-changed", MessageField.VALUE)
    )
    assert created_value[0] == 0 and created_value[5] == 0  # [0]: one byte
    assert phase_value[5:7] == b"\x02\x02"  # [1]: count 1, index 1, zigzag
    assert decode_input(b"wf-1", created_value, None, topic_carries=CREATED) == created
    assert decode_input(b"wf-1", phase_value, [], topic_carries=PHASE) == phase
    headers = [(k, v) for k, v in encode(phase).headers]
    assert decode_input(b"wf-1", phase_value, headers, topic_carries=PHASE) == phase
    assert "schema id" in wire_format(phase_value, headers)
    # The framing names PhaseChanged: on the created topic it is refused even without a ce_type.
    with pytest.raises(DecodeError, match="names another message"):
        decode_input(b"wf-1", phase_value, [], topic_carries=CREATED)


class _ConfluentMock:
    """The registry's HTTP answers taken from confluent-kafka's own in-process registry."""

    def __init__(self, client: SchemaRegistryClient) -> None:
        self.client = client
        self.calls = 0

    def __call__(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        self.calls += 1
        schema_id = int(url.rsplit("/", 1)[1])
        try:
            schema = self.client.get_schema(schema_id)
        except Exception:
            return 404, json.dumps({"error_code": 40403, "message": "Schema not found"}).encode()
        return 200, json.dumps({"schemaType": schema.schema_type, "schema": schema.schema_str}).encode()


def test_with_a_registry_the_id_is_looked_up_once_and_its_message_checked() -> None:
    client = SchemaRegistryClient.new_client({"url": "mock://wire-formats-registry"})
    phase = _phase()
    value = _serializer(client, inputs_pb2.PhaseChanged)(
        phase, SerializationContext("phase-changed", MessageField.VALUE)
    )
    fetch = _ConfluentMock(client)
    registry = schema_registry.SchemaRegistry("http://127.0.0.1:1", fetch=fetch)
    schema_registry.ACTIVE = registry
    # Not cached: the codec does not wait on the network; the record's transaction is retried.
    with pytest.raises(schema_registry.SchemaNotResolved):
        decode_input(b"wf-1", value, [], topic_carries=PHASE)
    registry.lookup_blocking(read_framing(value).schema_id)
    assert decode_input(b"wf-1", value, [], topic_carries=PHASE) == phase
    with pytest.raises(DecodeError, match=f"is '{PHASE}': on a topic that carries '{CREATED}' only"):
        decode_input(b"wf-1", value, [], topic_carries=CREATED)
    assert fetch.calls == 1
    # An id the registry does not have is the record's fault.
    unknown = write_framing(999, (1,), phase.SerializeToString())
    registry.lookup_blocking(999)
    with pytest.raises(DecodeError, match="schema id 999 is not in the schema registry"):
        decode_input(b"wf-1", unknown, [], topic_carries=PHASE)


def test_a_registry_that_does_not_answer_is_the_worlds_fault() -> None:
    registry = schema_registry.SchemaRegistry("http://127.0.0.1:1")  # nothing listens on port 1
    with pytest.raises(schema_registry.RegistryUnavailable):
        registry.lookup_blocking(1)
    assert registry.cached(1) is None


def test_proto_text_names_the_message_of_a_path() -> None:
    text = """
    syntax = "proto3";
    // message Commented { }
    package acme.v2;
    import "google/protobuf/timestamp.proto";
    message First { string message = 1; enum E { A = 0; } oneof o { string x = 2; } }
    message Second {
      message Inner { }
      message Other { message Deep {} }
    }
    /* message Hidden {} */
    service S { rpc R (First) returns (Second); }
    """
    proto = parse(text)
    assert proto.message_name((0,)) == "acme.v2.First"
    assert proto.message_name((1,)) == "acme.v2.Second"
    assert proto.message_name((1, 1, 0)) == "acme.v2.Second.Other.Deep"
    with pytest.raises(ValueError, match="past the schema's 2 message"):
        proto.message_name((2,))


# --- 3. protobuf JSON and CloudEvents structured mode ---------------------------------------------


def test_protobuf_json_is_read_by_content_type() -> None:
    event = _phase()
    text = json_format.MessageToJson(event)  # lowerCamelCase, enums by name, RFC 3339 times
    assert "executionId" in text and "EXECUTION_IN_PROGRESS" in text
    headers = [("content-type", b"application/json; charset=utf-8")]
    assert decode_input(b"wf-1", text.encode(), headers, topic_carries=PHASE) == event
    with pytest.raises(DecodeError, match="protobuf JSON"):
        decode_input(b"wf-1", b"{not json", headers, topic_carries=PHASE)


def _structured(message: Message, **data: object) -> bytes:
    event: dict[str, object] = {
        "specversion": "1.0",
        "type": type_name(message),
        "source": "test",
        "id": "ce-1",
        **data,
    }
    return json.dumps(event).encode()


def test_cloudevents_structured_mode_with_data_base64_and_json_data() -> None:
    event = _created()
    headers = [("content-type", b"application/cloudevents+json; charset=UTF-8")]
    base64_value = _structured(
        event,
        datacontenttype="application/protobuf",
        data_base64=base64.b64encode(event.SerializeToString()).decode(),
    )
    assert decode_input(b"wf-1", base64_value, headers, topic_carries=CREATED) == event
    json_value = _structured(event, datacontenttype="application/json", data=json_format.MessageToDict(event))
    assert decode_input(b"wf-1", json_value, headers, topic_carries=CREATED) == event
    assert wire_format(json_value, headers) == "CloudEvents structured"
    # Its type still has to be the topic's.
    with pytest.raises(DecodeError, match="on a topic that carries"):
        decode_input(b"wf-1", base64_value, headers, topic_carries=PHASE)
    for broken, reason in [
        (b"[1]", "not a JSON object"),
        (json.dumps({"id": "x"}).encode(), "without a 'type'"),
        (_structured(event, data_base64="@@@"), "not base64"),
    ]:
        with pytest.raises(DecodeError, match=reason):
            decode_input(b"wf-1", broken, headers, topic_carries=CREATED)


def test_a_structured_event_may_carry_framed_bytes() -> None:
    event = _created()
    framed = write_framing(3, (0,), event.SerializeToString())
    value = _structured(event, data_base64=base64.b64encode(framed).decode())
    headers = [("content-type", b"application/cloudevents+json")]
    assert decode_input(b"wf-1", value, headers, topic_carries=CREATED) == event


def test_the_framings_header_is_big_endian() -> None:
    assert read_framing(struct.pack(">bi", 0, 0x01020304) + b"\x00").schema_id == 0x01020304
