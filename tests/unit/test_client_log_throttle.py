"""The Kafka clients' lines through an outage: at most WARNING, one of a kind per minute."""

from __future__ import annotations

import io
import json
import logging

from consumers.ops.logs import CLIENT_LINE_EVERY_S, setup_logging


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_flood_of_client_errors_is_one_warning_a_minute_and_the_pods_own_error_passes() -> None:
    out = io.StringIO()
    setup_logging("info", stream=out, json_lines=True)
    client = logging.getLogger("aiokafka.consumer.fetcher")
    own = logging.getLogger("sandbox_lanes.pod")
    now = [1000.0]
    real_time = logging.time.time  # type: ignore[attr-defined]
    logging.time.time = lambda: now[0]  # type: ignore[attr-defined]  # LogRecord.created
    try:
        for i in range(7_000):  # a 40 s outage's worth, 5.7 ms apart
            client.error("Failed fetch messages from %s: [Error 7] RequestTimedOutError", i % 3)
            now[0] += 40 / 7_000
        own.error("reaching the Kafka cluster failed; retrying with backoff until it succeeds")
        now[0] += CLIENT_LINE_EVERY_S
        client.error("Failed fetch messages from %s: [Error 7] RequestTimedOutError", 1)
    finally:
        logging.time.time = real_time  # type: ignore[attr-defined]
        logging.getLogger().handlers.clear()
    lines = _lines(out)
    from_client = [line for line in lines if line["logger"] == "aiokafka.consumer.fetcher"]
    assert [line["level"] for line in from_client] == ["warning", "warning"]
    assert from_client[1]["suppressed"] == 6_999
    assert [line["level"] for line in lines if line["logger"] == "sandbox_lanes.pod"] == ["error"]
