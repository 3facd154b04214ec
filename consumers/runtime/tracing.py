"""OpenTelemetry traces of the pod: off by default, on with the standard ``OTEL_*`` variables.

Off, nothing of OpenTelemetry is imported and every hook is one ``tracing.ACTIVE is None`` check.
On (:func:`configure`: ``OTEL_TRACES_EXPORTER=otlp`` or an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``;
``OTEL_SDK_DISABLED=true`` wins), spans go to the OTLP/HTTP exporter through the SDK's batch
processor, whose thread exports them: the event loop only queues a finished span.

One execution's trace (docs/operations.md, Tracing):

* ``process <topic>`` (consumer) per input record, the child of the producer's ``traceparent``
  header when it has one, and linked to it; messaging attributes (system, destination, partition,
  offset, message id, consumer group).
* ``decide`` under it; its ``traceparent`` is recorded on each effect it decides
  (``PendingEffect.traceparent``), so the driver call's span finds it after the commit, or on the
  pod that takes the partition over.
* ``commit`` under the input's span: the transaction that made the decision durable.
* ``driver <operation>`` per effect's driver call: the child of the decision, linked to it.
* ``send <outcomes topic>`` (producer) under the driver call, for each outcome record it folds back;
  the record carries its ``traceparent`` header, so the next consumer continues the trace; and a
  ``commit`` under the driver call for the fold's transaction.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiokafka import ConsumerRecord
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from consumers.lanes.commands import Command, CommandResult
    from events.sandbox_lanes.v1 import state_pb2

#: The pod's tracing when it is on; None when off (the default). Every hook checks this first.
ACTIVE: Tracing | None = None

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


def wanted(env: Mapping[str, str]) -> bool:
    """Do the standard variables turn tracing on? (Off unless an exporter or endpoint is named.)"""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(env: Mapping[str, str] | None = None, *, group: str = "") -> Tracing | None:
    """Turn tracing on when the variables ask for it (once per process); returns :data:`ACTIVE`."""
    global ACTIVE
    env = os.environ if env is None else env
    if ACTIVE is not None or not wanted(env):
        return ACTIVE
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    if exporter != "otlp" or protocol not in ("", "http/protobuf"):
        raise ValueError(
            f"tracing: only the OTLP exporter over http/protobuf is supported "
            f"(OTEL_TRACES_EXPORTER={exporter!r}, protocol {protocol!r})"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:  # pragma: no cover - the [tracing] extra is not installed
        raise ValueError(
            "tracing is on (OTEL_* variables) but OpenTelemetry is not installed: "
            "pip install 'sandbox-lanes[tracing]'"
        ) from exc
    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, the sampler (OTEL_TRACES_SAMPLER), the endpoint,
    # headers and timeouts (OTEL_EXPORTER_OTLP_*) and the batch (OTEL_BSP_*) are read by the SDK.
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": "sandbox-lanes"}
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=True)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    ACTIVE = Tracing(provider, group)
    return ACTIVE


def shutdown() -> None:
    """Flush and stop the exporter; tracing is off again."""
    global ACTIVE
    active, ACTIVE = ACTIVE, None
    if active is not None:
        active.provider.shutdown()


class Tracing:
    def __init__(self, provider: TracerProvider, group: str = "") -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.group = group
        self.tracer: Tracer = provider.get_tracer("sandbox_lanes")
        self._trace = trace
        self._context = context
        self._propagator = TraceContextTextMapPropagator()

    def flush(self, timeout_ms: int = 10_000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    # --- context in and out of records ---------------------------------------------------------

    def _extract(self, carrier: Mapping[str, str]) -> Context:
        return self._propagator.extract(carrier)

    def traceparent(self, span: Span) -> str:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT, "")

    def _linked(
        self, traceparent: str, carrier: Mapping[str, str] | None = None
    ) -> tuple[Context | None, list[Any]]:
        """The context a ``traceparent`` names (as a parent) and a link to it; none when absent or
        malformed (``carrier``: the whole header set, with a ``tracestate``). A trace header is the
        producer's hint, never a reason to fail a record: whatever cannot be read starts a fresh trace."""
        if not traceparent:
            return None, []
        try:
            ctx = self._extract(carrier if carrier is not None else {TRACEPARENT: traceparent})
            span_context = self._trace.get_current_span(ctx).get_span_context()
            if not span_context.is_valid:
                return None, []
            return ctx, [self._trace.Link(span_context)]
        except Exception:  # a propagator's surprise on odd input: the trace starts fresh
            return None, []

    @contextlib.contextmanager
    def under(self, traceparent: str) -> Iterator[None]:
        """The span a ``traceparent`` names is current inside (log lines name it)."""
        parent, _ = self._linked(traceparent)
        if parent is None:
            yield
            return
        token = self._context.attach(parent)
        try:
            yield
        finally:
            self._context.detach(token)

    def ids(self) -> tuple[str, str] | None:
        """(trace id, span id) in hex of the span current now (a log line's), or None."""
        span_context = self._trace.get_current_span().get_span_context()
        if not span_context.is_valid:
            return None
        return format(span_context.trace_id, "032x"), format(span_context.span_id, "016x")

    # --- the consumer side: one input record ---------------------------------------------------

    @contextlib.contextmanager
    def input(self, rec: ConsumerRecord[bytes, bytes]) -> Iterator[Span]:
        """The ``process <topic>`` span of one input record, current while it is decided."""
        headers = trace_headers(rec.headers)
        parent, links = self._linked(headers.get(TRACEPARENT, ""), headers)
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": rec.topic,
            "messaging.destination.partition.id": str(rec.partition),
            "messaging.kafka.offset": rec.offset,
        }
        if self.group:
            attributes["messaging.consumer.group.name"] = self.group
        if rec.key is not None:
            attributes["messaging.kafka.message.key"] = rec.key.decode("utf-8", "replace")
        with self.tracer.start_as_current_span(
            f"process {rec.topic}",
            context=parent,
            kind=self._trace.SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
        ) as span:
            yield span

    def decided(self) -> Span:
        """A ``decide`` span under the current input's; end it with :meth:`end_decision`."""
        return self.tracer.start_span("decide")

    def end_decision(
        self,
        span: Span,
        *,
        message_id: str,
        event_type: str,
        key: str,
        outcome: str,
        state: state_pb2.ExecutionState | None,
        effect_ids: Sequence[str],
    ) -> None:
        """Name the decision on its span and the input's, record its context on its new effects."""
        current = self._trace.get_current_span()
        current.set_attribute("messaging.message.id", message_id)
        current.set_attribute("sandbox_lanes.event.type", event_type)
        span.set_attributes(
            {
                "messaging.message.id": message_id,
                "sandbox_lanes.event.type": event_type,
                "sandbox_lanes.execution.id": key,
                "sandbox_lanes.decision": outcome,
                "sandbox_lanes.effects": len(effect_ids),
            }
        )
        if state is not None and effect_ids:
            parent = self.traceparent(span)
            wanted_ids = set(effect_ids)
            for effect in state.pending:
                if effect.effect_id in wanted_ids:
                    effect.traceparent = parent
        span.end()

    def current_context(self) -> Any:
        """The current span's context (what a ``commit`` span is opened under)."""
        return self._trace.get_current_span().get_span_context()

    # --- the driver call, the outcome, the commit ----------------------------------------------

    async def effect(
        self,
        decision: str,
        command: Command,
        driver: str,
        run: Callable[[Command], Awaitable[CommandResult]],
    ) -> tuple[CommandResult, str]:
        """Run one effect's driver call under a ``driver <operation>`` span, the decision's child
        and linked to it; returns the result and the span's ``traceparent``."""
        from drivers.naming import sandbox_base_name

        parent, links = self._linked(decision)
        operation = type(command).__name__.lower()
        span = self.tracer.start_span(
            f"driver {operation}",
            context=parent if parent is not None else self._context.Context(),
            kind=self._trace.SpanKind.CLIENT,
            links=links,
            attributes={
                "sandbox_lanes.driver": driver,
                "sandbox_lanes.operation": operation,
                "sandbox_lanes.sandbox.scope": command.scope,
                "sandbox_lanes.sandbox.id": command.sandbox_id,
                "sandbox_lanes.sandbox.name": sandbox_base_name(command.scope, command.sandbox_id),
            },
        )
        try:
            with self._trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):  # current while the driver runs: the call's log lines name it
                result = await run(command)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(self._trace.StatusCode.ERROR)
            span.end()
            raise
        span.set_attribute("sandbox_lanes.result", "ok" if result.ok else "error")
        if not result.ok:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, result.error))
        span.end()
        return result, self.traceparent(span)

    def outcome_headers(self, effect: str, topic: str, headers: list[tuple[str, bytes]]) -> Any:
        """A ``send <topic>`` span under the effect's; returns the record's headers with its
        ``traceparent`` (the effect's context, to open the fold's ``commit`` span under)."""
        parent, _ = self._linked(effect)
        span = self.tracer.start_span(
            f"send {topic}",
            context=parent,
            kind=self._trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.destination.name": topic,
            },
        )
        value = self.traceparent(span).encode()
        span.end()
        return [*(h for h in headers if h[0] != TRACEPARENT), (TRACEPARENT, value)]

    def parent_of(self, traceparent: str) -> Any:
        """The span context a ``traceparent`` names (for :meth:`committed`), or None."""
        parent, _ = self._linked(traceparent)
        if parent is None:
            return None
        return self._trace.get_current_span(parent).get_span_context()

    async def commit(self, under: Sequence[Any], partition: int, commit: Awaitable[None]) -> None:
        """Await ``commit``, then record a ``commit`` span of its duration under each span of ``under``."""
        start = time.time_ns()
        error: BaseException | None = None
        try:
            await commit
        except BaseException as exc:
            error = exc
            raise
        finally:
            end = time.time_ns()
            for span_context in under:
                span = self.tracer.start_span(
                    "commit",
                    context=self._trace.set_span_in_context(self._trace.NonRecordingSpan(span_context)),
                    start_time=start,
                    attributes={"sandbox_lanes.partition": partition},
                )
                if error is not None:
                    span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, repr(error)))
                span.end(end_time=end)


_TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})


def trace_headers(headers: Sequence[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """A record's ``traceparent`` and ``tracestate`` as text; a header with a null value (Kafka
    allows one) or one that is not bytes is left out, as if absent. The last of repeated headers wins."""
    found: dict[str, str] = {}
    for key, value in headers or ():
        if key in _TRACE_HEADERS and isinstance(value, (bytes, bytearray, memoryview)):
            found[key] = bytes(value).decode("utf-8", "replace")
    return found


def decision_traceparent(state: state_pb2.ExecutionState | None, effect_id: str) -> str:
    """The ``traceparent`` recorded with an effect by its decision ("" = none)."""
    if state is None:
        return ""
    for effect in state.pending:
        if effect.effect_id == effect_id:
            return effect.traceparent
    return ""
