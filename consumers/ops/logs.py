"""Structured logs: one JSON object a line (human-readable on a terminal), secrets redacted.

Fields passed as ``extra=`` become top-level keys. A redaction filter masks
anything shaped like a JWT or a known secret value, so even a driver error that
echoes its input cannot leak a token.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from consumers.runtime import tracing

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}")
REDACTED = "[REDACTED]"


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    text = _JWT.sub(REDACTED, text)
    for secret in secrets:
        if secret and len(secret) >= 6:
            text = text.replace(secret, REDACTED)
    return text


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._secrets = tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            payload[key] = value if isinstance(value, int | float | bool) or value is None else str(value)
        active = tracing.ACTIVE
        if active is not None:  # tracing on: a line logged under a span names it
            ids = active.ids()
            if ids is not None:
                payload["trace_id"], payload["span_id"] = ids
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return redact(json.dumps(payload, ensure_ascii=False), self._secrets)


class HumanFormatter(logging.Formatter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._secrets = tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        when = dt.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        extra = record_fields(record)
        active = tracing.ACTIVE
        if active is not None:
            ids = active.ids()
            if ids is not None:
                extra["trace_id"], extra["span_id"] = ids
        fields = " ".join(f"{k}={v}" for k, v in extra.items())
        line = f"{when} {record.levelname:<7} {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line, self._secrets)


#: The Kafka clients' own loggers (aiokafka; librdkafka through the transactional producer).
CLIENT_LOGGERS: tuple[str, ...] = ("aiokafka", "kafka", "sandbox_lanes.librdkafka")
#: One line of a kind from a Kafka client per this many seconds at most.
CLIENT_LINE_EVERY_S = 60.0
_DIGITS = re.compile(r"\d+")


class ClientLogThrottle(logging.Filter):
    """The Kafka clients' lines, as an operator can read them through an outage.

    aiokafka and librdkafka log every failed attempt of a retry loop at ERROR ("Unable connect to
    node", "Failed fetch messages", a coordinator lookup): 7,000 lines in a 40 s outage, 100,000 in
    ten minutes. The pod's own episodes already say, once, at ERROR, that the world fails and when
    it is back (resilience.episode). So a client's line is at most a WARNING, and a line of the same
    kind (its logger and its text without numbers) passes once per :data:`CLIENT_LINE_EVERY_S`,
    carrying how many like it were held back since (``suppressed``).
    """

    def __init__(self, every_s: float = CLIENT_LINE_EVERY_S) -> None:
        super().__init__()
        self._every = every_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(CLIENT_LOGGERS):
            return True
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        key = (record.name, _DIGITS.sub("#", str(record.msg))[:200])
        last, held = self._last.get(key, (float("-inf"), 0))
        if record.created - last < self._every:
            self._last[key] = (last, held + 1)
            return False
        if held:
            record.suppressed = held
        if len(self._last) > 1_000:  # kinds are few; bound it all the same
            self._last.clear()
        self._last[key] = (record.created, 0)
        return True


#: ``SANDBOX_LANES_LOG_FORMAT`` → ``setup_logging(json_lines=…)``: auto = JSON unless a terminal.
JSON_LINES_BY_FORMAT: dict[str, bool | None] = {"auto": None, "json": True, "human": False}


def setup_logging(
    level: str | None = "info",
    *,
    stream: TextIO | None = None,
    json_lines: bool | None = None,
    secrets: Iterable[str] = (),
) -> None:
    level = level or "info"
    out = stream or sys.stderr
    use_json = (not out.isatty()) if json_lines is None else json_lines
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter(secrets) if use_json else HumanFormatter(secrets))
    handler.addFilter(ClientLogThrottle())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
