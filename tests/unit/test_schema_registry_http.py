"""The registry client's HTTP: a lookup and a registration through urllib against an HTTP server on
127.0.0.1 that answers as the Confluent API does (its content from confluent-kafka's in-process
registry: no registry server runs here), each id fetched once however many records ask at once."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from events import schema_registry
from events.output_format import register_outcomes
from events.sandbox_lanes.v1 import inputs_pb2

INPUTS_TEXT = """syntax = "proto3";
package sandbox_lanes.v1;
message ExecutionCreated { string execution_id = 3; }
message PhaseChanged { string execution_id = 2; }
"""


class _Registry(BaseHTTPRequestHandler):
    client: SchemaRegistryClient
    gets: list[str]

    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.gets.append(self.path)
        schema_id = int(self.path.rsplit("/", 1)[1])
        try:
            schema = self.client.get_schema(schema_id)
        except Exception:
            self._send(404, {"error_code": 40403, "message": "Schema not found"})
            return
        self._send(200, {"schemaType": schema.schema_type, "schema": schema.schema_str})

    def do_POST(self) -> None:
        sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        subject = urllib.parse.unquote(self.path.split("/subjects/", 1)[1].split("/", 1)[0])
        schema = Schema(sent["schema"], sent["schemaType"], [])
        if self.path.endswith("/versions"):
            self._send(200, {"id": self.client.register_schema(subject, schema)})
        else:
            found = self.client.lookup_schema(subject, schema)
            self._send(200, {"id": found.schema_id, "version": found.version})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def registry_url() -> Iterator[tuple[str, type[_Registry]]]:
    handler = type(
        "Handler",
        (_Registry,),
        {"client": SchemaRegistryClient.new_client({"url": "mock://http"}), "gets": []},
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/apis/ccompat/v7", handler
    server.shutdown()
    server.server_close()


def test_a_lookup_over_http_is_fetched_once_and_a_missing_id_is_the_records(
    registry_url: tuple[str, type[_Registry]],
) -> None:
    url, handler = registry_url
    schema_id = handler.client.register_schema("phase-changed-value", Schema(INPUTS_TEXT, "PROTOBUF"))
    registry = schema_registry.SchemaRegistry(url)

    async def many() -> list[schema_registry.RegisteredSchema]:
        return await asyncio.gather(*(registry.resolve(schema_id) for _ in range(20)))

    answers = asyncio.run(many())
    assert {a.message_name((1,)) for a in answers} == {inputs_pb2.PhaseChanged.DESCRIPTOR.full_name}
    assert handler.gets == [f"/apis/ccompat/v7/schemas/ids/{schema_id}"]
    missing = registry.lookup_blocking(4242)
    with pytest.raises(ValueError, match="schema id 4242 is not in the schema registry"):
        missing.message_name((0,))


def test_the_outcomes_are_registered_over_http(registry_url: tuple[str, type[_Registry]]) -> None:
    url, handler = registry_url
    registry = schema_registry.SchemaRegistry(url)
    schema_id = register_outcomes(registry, "sandbox-outcomes")
    assert handler.client.get_schema(schema_id).schema_str.startswith("// Outcome events")
    assert sorted(handler.client.get_subjects()) == [
        "events/sandbox_lanes/v1/common.proto",
        "sandbox-outcomes-value",
    ]
    assert registry.cached(schema_id) is not None
