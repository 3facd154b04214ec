"""Traces (issue 36): one execution's spans received over OTLP/HTTP by a real endpoint.

The pod exports with the OpenTelemetry SDK's OTLP/HTTP exporter, turned on by the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variable, to a receiver in the test (aiohttp on a loopback
port) that decodes each request with the official ``opentelemetry-proto`` package. The execution
crosses a take-over: pod A decides and commits, its driver call hangs and is cut off by its shutdown,
pod B takes the partition over and runs the effect from the state's outbox. The trace: the input's
``process`` span under (and linked to) the producer's ``traceparent``, the ``decide`` and ``commit``
spans under it, pod B's ``driver ensure`` span under and linked to pod A's decision, the outcome's
``send`` span under that, and the outcome record's ``traceparent`` header naming it. Log lines of
the traced record carry its trace and span ids.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from harness.memory_driver import MemoryProvisioner
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from consumers.ops.logs import JsonFormatter
from consumers.ops.settings import load_settings
from consumers.runtime import tracing
from events.codec import encode
from tests.support.pod_harness import produce_raw, read_topic, running_pod, unique_env, wf_created


class Hanging(MemoryProvisioner):
    """A driver whose ensure starts and never returns (until cancelled)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.started = asyncio.Event()

    async def ensure(self, scope: Any, sandbox_id: str, env: Any) -> Any:
        self.started.set()
        await asyncio.Event().wait()


class Receiver:
    """An OTLP/HTTP traces endpoint: every span of every request, decoded."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert request.content_type == "application/x-protobuf", request.content_type
        export = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        self.requests += 1
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return web.Response(
            body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def logs() -> Iterator[Captured]:
    handler = Captured()
    root = logging.getLogger("sandbox_lanes")
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def hexid(raw: bytes) -> str:
    return raw.hex()


@pytest.mark.kafka
async def test_one_execution_trace_across_a_take_over(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: Captured
) -> None:
    import json

    receiver = Receiver()
    await receiver.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{receiver.port}/v1/traces")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sandbox-lanes-test")
    assert tracing.ACTIVE is None
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_SHUTDOWN_TIMEOUT_S="1"
    )
    topics = load_settings(env).topics
    producer_trace, producer_span = secrets.token_hex(16), secrets.token_hex(8)
    event = wf_created("wfx_traced_1")
    record = encode(event)
    try:
        # Pod A decides and commits; its ensure hangs and its shutdown cuts it off.
        hanging = Hanging()
        async with running_pod(env, provisioner=hanging) as composed:
            assert tracing.ACTIVE is not None
            await produce_raw(
                kafka_bootstrap,
                topics.execution_created,
                record.value,
                record.key,
                [*record.headers, ("traceparent", f"00-{producer_trace}-{producer_span}-01".encode())],
            )
            await asyncio.wait_for(hanging.started.wait(), 30)  # decided, committed, called
            assert composed.pod.effects.outstanding == 1
        # Pod B takes the partition over and runs the effect from the outbox.
        env_b = {**env, "SANDBOX_LANES_POD_ID": "pod-b"}
        async with running_pod(env_b, provisioner=MemoryProvisioner()):
            (outcome,) = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
            assert type(outcome.message).__name__ == "SandboxProvisioned"
        assert tracing.ACTIVE is not None and tracing.ACTIVE.flush()
    finally:
        tracing.shutdown()
        await receiver.stop()

    spans = [s for s in receiver.spans if hexid(s.trace_id) == producer_trace]
    by_name: dict[str, list[trace_pb2.Span]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    names = sorted(by_name)
    assert receiver.requests >= 1

    # The input: a consumer span under the producer's context, linked to it, with the messaging
    # attributes.
    (process,) = by_name[f"process {topics.execution_created}"]
    assert process.kind == trace_pb2.Span.SPAN_KIND_CONSUMER
    assert hexid(process.parent_span_id) == producer_span
    assert [(hexid(link.trace_id), hexid(link.span_id)) for link in process.links] == [
        (producer_trace, producer_span)
    ]
    attributes = {a.key: a.value for a in process.attributes}
    assert attributes["messaging.system"].string_value == "kafka"
    assert attributes["messaging.destination.name"].string_value == topics.execution_created
    assert attributes["messaging.destination.partition.id"].string_value in ("0", "1")
    assert attributes["messaging.kafka.offset"].int_value == 0
    assert attributes["messaging.message.id"].string_value == event.meta.event_id

    # The decision and the commit under it.
    (decide,) = by_name["decide"]
    assert decide.parent_span_id == process.span_id
    decide_attributes = {a.key: a.value for a in decide.attributes}
    assert decide_attributes["sandbox_lanes.decision"].string_value == "applied"
    assert decide_attributes["sandbox_lanes.effects"].int_value == 1
    commits = by_name["commit"]
    assert any(c.parent_span_id == process.span_id for c in commits), names

    # The effect: pod A's call (cut off) and pod B's, both under and linked to the decision.
    drivers = by_name["driver ensure"]
    assert len(drivers) == 2, [(d.name, d.status) for d in drivers]
    for driver in drivers:
        assert driver.parent_span_id == decide.span_id
        assert [link.span_id for link in driver.links] == [decide.span_id]
    done = [d for d in drivers if d.status.code != trace_pb2.Status.STATUS_CODE_ERROR]
    assert len(done) == 1, [d.status for d in drivers]
    driver_attributes = {a.key: a.value for a in done[0].attributes}
    assert driver_attributes["sandbox_lanes.driver"].string_value == "memory"
    assert driver_attributes["sandbox_lanes.result"].string_value == "ok"
    assert driver_attributes["sandbox_lanes.sandbox.id"].string_value == "wfx_traced_1"
    assert driver_attributes["sandbox_lanes.sandbox.name"].string_value

    # The outcome: a producer span under pod B's driver call, named by the record's traceparent; the
    # fold's commit under the driver call too.
    (send,) = by_name[f"send {topics.outcomes}"]
    assert send.kind == trace_pb2.Span.SPAN_KIND_PRODUCER and send.parent_span_id == done[0].span_id
    assert outcome.headers["traceparent"] == f"00-{producer_trace}-{hexid(send.span_id)}-01"
    assert any(c.parent_span_id == done[0].span_id for c in commits), names

    # Log lines of the traced record carry its ids.
    traced_lines = [json.loads(line) for line in logs.lines if producer_trace in line]
    assert traced_lines, logs.lines[-20:]
    assert all(line["trace_id"] == producer_trace and len(line["span_id"]) == 16 for line in traced_lines)
    span_ids = {hexid(s.span_id) for s in spans}
    assert {line["span_id"] for line in traced_lines} <= span_ids
