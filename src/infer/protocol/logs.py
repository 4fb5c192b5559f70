"""The one logging setup of every command (infer-coordinator, infer-worker, infer-serve, infer-api).

`--log-format text` (the default) writes "time LEVEL logger: message" lines; `--log-format json` writes one
JSON object per line (ts, level, logger, message, and exc_info when there is a traceback), for log
collectors. Either way a record is one line: peer text is escaped before it is logged (protocol.logsafe),
and a JSON line escapes whatever else a message holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TextIO

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: {"ts", "level", "logger", "message"[, "exc_info"]}."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def add_logging_args(parser: argparse.ArgumentParser, default_level: str = "INFO") -> None:
    """--log-level and --log-format, the same on every command."""
    parser.add_argument("--log-level", default=default_level, type=str.upper, choices=LOG_LEVELS)
    parser.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS, help="text lines (default) or one JSON object per line"
    )


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None, force: bool = False) -> None:
    """Configure the root logger of a command's process. Like logging.basicConfig, a no-op when the root
    logger has handlers already (a main() run inside pytest or another application) unless `force`."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=force)


def logging_argv(level: str = "INFO", fmt: str = "text") -> list[str]:
    """The flags that give a child command (one that called add_logging_args) this level and format."""
    return ["--log-level", level, "--log-format", fmt]


def logging_flags(args: argparse.Namespace) -> list[str]:
    """The logging flags of `args`, to hand on to child processes."""
    return logging_argv(args.log_level, args.log_format)
