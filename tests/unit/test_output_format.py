"""Outcomes in the Schema Registry wire format (``SANDBOX_LANES_OUTPUT_FORMAT=schema-registry``): the
schema registered with its reference, every outcome framed with its id and index, read back by
confluent-kafka's own ``ProtobufDeserializer`` and by the pod's codec; states stay unframed."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator

import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from consumers.ops.settings import ConfigError, load_settings
from events import schema_registry
from events.codec import OUTCOME_TYPES, decode, encode, frame_outcomes, new_meta
from events.output_format import COMMON_PROTO, register_outcomes
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2, state_pb2
from events.wire_formats import read_framing


class _ConfluentRegistry:
    """The registry's HTTP API answered by confluent-kafka's in-process registry (no server runs here)."""

    def __init__(self) -> None:
        self.client = SchemaRegistryClient.new_client({"url": "mock://output-format"})
        self.calls: list[tuple[str, str]] = []

    def __call__(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        path = urllib.parse.unquote(url.split("://", 1)[1].split("/", 1)[1])
        self.calls.append((method, path))
        assert body is not None
        sent = json.loads(body)
        refs = [SchemaReference(r["name"], r["subject"], r["version"]) for r in sent["references"]]
        schema = Schema(sent["schema"], sent["schemaType"], refs)
        if path.endswith("/versions"):
            subject = path.removeprefix("subjects/").removesuffix("/versions")
            return 200, json.dumps({"id": self.client.register_schema(subject, schema)}).encode()
        found = self.client.lookup_schema(path.removeprefix("subjects/"), schema)
        return 200, json.dumps({"version": found.version, "id": found.schema_id}).encode()


@pytest.fixture(autouse=True)
def _unframed() -> Iterator[None]:
    yield
    frame_outcomes(None)
    schema_registry.configure("")


def test_outcomes_are_framed_for_kafka_protobuf_deserializer() -> None:
    fake = _ConfluentRegistry()
    registry = schema_registry.SchemaRegistry("http://127.0.0.1:1", fetch=fake)
    schema_id = register_outcomes(registry, "sandbox-outcomes")
    assert [c for c in fake.calls if c[0] == "POST" and c[1].endswith("/versions")] == [
        ("POST", f"subjects/{COMMON_PROTO}/versions"),
        ("POST", "subjects/sandbox-outcomes-value/versions"),
    ]
    frame_outcomes(schema_id)
    failed = outcomes_pb2.SandboxFailed(meta=new_meta(), execution_id="wf-1", reason="no capacity")
    record = encode(failed)
    framing = read_framing(record.value)
    assert framing.schema_id == schema_id and framing.indexes == (1,)  # the file's second message
    deserializer = ProtobufDeserializer(outcomes_pb2.SandboxFailed, {"use.deprecated.format": False})
    read = deserializer(record.value, SerializationContext("sandbox-outcomes", MessageField.VALUE))
    assert read == failed
    # The pod's own readers (tail, replay) read it too: the registry knows the id it registered.
    schema_registry.ACTIVE = registry
    assert decode(record.key, record.value, record.headers, allowed=OUTCOME_TYPES) == failed
    # A state is no outcome: it stays the project's own format.
    state = encode(state_pb2.ExecutionState(execution_id="wf-1", kind=common_pb2.WORKFLOW_EXECUTION))
    assert state.value[:1] != b"\x00"


def test_the_schema_registry_output_needs_a_registry() -> None:
    with pytest.raises(ConfigError, match="needs SANDBOX_LANES_SCHEMA_REGISTRY_URL"):
        load_settings({"SANDBOX_LANES_OUTPUT_FORMAT": "schema-registry"})
    settings = load_settings(
        {
            "SANDBOX_LANES_OUTPUT_FORMAT": "schema-registry",
            "SANDBOX_LANES_SCHEMA_REGISTRY_URL": "http://r:8080/",
        }
    )
    assert (settings.output_format, settings.schema_registry_url) == ("schema-registry", "http://r:8080")
    assert load_settings({}).output_format == "cloudevents"
