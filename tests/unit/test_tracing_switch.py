"""Tracing's switch (consumers.runtime.tracing): off unless the standard OTEL_* variables ask, and off
means nothing of OpenTelemetry is loaded. The traces themselves: tests/integration/test_tracing.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from consumers.runtime import tracing


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
    ],
)
def test_off_unless_the_standard_variables_ask(env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(env) is on


def test_an_unsupported_exporter_or_protocol_is_refused() -> None:
    for env in (
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    ):
        with pytest.raises(ValueError, match="only the OTLP exporter over http/protobuf"):
            tracing.configure(env)
    assert tracing.ACTIVE is None


def test_off_loads_nothing_of_opentelemetry() -> None:
    code = (
        "import sys, logging\n"
        "from consumers.ops.compose import compose\n"
        "from consumers.ops.logs import JsonFormatter\n"
        "from consumers.runtime import tracing\n"
        "assert tracing.configure({}) is None and tracing.ACTIVE is None\n"
        "JsonFormatter().format(logging.LogRecord('x', 20, 'f', 1, 'm', (), None))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
