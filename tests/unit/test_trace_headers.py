"""A record's trace headers are the producer's hint, never a reason to fail the record (issue 42, 5).

Kafka lets a header carry a null value, and a producer may write anything under ``traceparent``. With
tracing on, such a record must be decided like any other: its ``process`` span starts a fresh trace.
Before, a null ``traceparent`` raised ``AttributeError`` inside the record's decision, which the pod
classes as the world's: the partition was retried for ever. The spans here are the real SDK's, kept by
its in-memory exporter; the records are aiokafka's own ``ConsumerRecord``. The whole trace on a real
broker is tests/integration/test_tracing.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from aiokafka import ConsumerRecord
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from consumers.runtime.tracing import Tracing, trace_headers

PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"
VALID = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01".encode()


@pytest.fixture
def traced() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Tracing(provider, "group"), exporter
    provider.shutdown()


def _record(headers: Sequence[tuple[str, bytes | None]]) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("execution-created", 0, 7, 1_000, 0, b"k", b"v", None, 1, 1, headers)


def _process_span(
    tracing: Tracing, exporter: InMemorySpanExporter, headers: Sequence[tuple[str, bytes | None]]
) -> ReadableSpan:
    with tracing.input(_record(headers)):
        pass
    (span,) = exporter.get_finished_spans()
    exporter.clear()
    return span


def test_a_valid_traceparent_is_the_parent(traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    """The positive control: a readable header is followed (so 'fresh' below is not the only answer)."""
    tracing, exporter = traced
    span = _process_span(tracing, exporter, [("traceparent", VALID)])
    assert span.parent is not None and format(span.parent.span_id, "016x") == PRODUCER_SPAN
    assert format(span.context.trace_id, "032x") == PRODUCER_TRACE
    assert [format(link.context.span_id, "016x") for link in span.links] == [PRODUCER_SPAN]


@pytest.mark.parametrize(
    "headers",
    [
        [("traceparent", None)],
        [("traceparent", None), ("tracestate", b"vendor=x")],
        [("traceparent", None), ("tracestate", None)],
        [("traceparent", b"")],
        [("traceparent", b"\xff\xfe\x00 not utf-8")],
        [("traceparent", b"00-not-a-trace-01")],
        [("traceparent", b"00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01")],  # all-zero ids: invalid
        [("traceparent", b"ff-" + PRODUCER_TRACE.encode() + b"-" + PRODUCER_SPAN.encode() + b"-01")],
        [("traceparent", b"x" * 10_000)],
    ],
    ids=[
        "null",
        "null-with-tracestate",
        "both-null",
        "empty",
        "not-utf8",
        "malformed",
        "zero-ids",
        "forbidden-version",
        "huge",
    ],
)
def test_a_null_or_malformed_traceparent_starts_a_fresh_trace(
    traced: tuple[Tracing, InMemorySpanExporter], headers: Sequence[tuple[str, bytes | None]]
) -> None:
    tracing, exporter = traced
    span = _process_span(tracing, exporter, headers)
    assert span.parent is None
    assert span.links == () or list(span.links) == []
    assert format(span.context.trace_id, "032x") != PRODUCER_TRACE
    assert span.context.is_valid


def test_a_malformed_tracestate_beside_a_valid_traceparent_keeps_the_parent(
    traced: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = traced
    for tracestate in (None, b"\xff\xfe", b"=,=,,==", b"k=" + b"v" * 5_000):
        span = _process_span(tracing, exporter, [("traceparent", VALID), ("tracestate", tracestate)])
        assert span.parent is not None and format(span.parent.span_id, "016x") == PRODUCER_SPAN, tracestate


def test_trace_headers_leave_a_null_value_out() -> None:
    assert trace_headers([("traceparent", None), ("tracestate", b"a=b"), ("other", b"x")]) == {
        "tracestate": "a=b"
    }
    assert trace_headers(None) == {}
    assert trace_headers([("traceparent", b"one"), ("traceparent", b"two")]) == {"traceparent": "two"}
