"""Structured logs: one JSON object per line on stderr, carrying the request id of the task that logs."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

#: The request id of the work the current asyncio task does; set by the request handlers.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_request_id", default=None)

_RESERVED = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON with `ts`, `level`, `component`, `msg`, `request_id` and any `extra` fields."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid:
            entry["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(component: str, level: str | None = None) -> None:
    """Routes every logger to JSON lines on stderr; `TANDEM_LOG_LEVEL` sets the level (default info)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("TANDEM_LOG_LEVEL", "info")).upper())
    for noisy in ("aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
