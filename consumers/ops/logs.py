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
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
