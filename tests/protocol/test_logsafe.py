"""protocol.logsafe (peer text in log lines) and protocol.logs (the shared logging setup)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from infer.protocol.logs import logging_argv, logging_flags, setup_logging
from infer.protocol.logsafe import RateLimitedLog, Throttle, safe


def test_safe_escapes_newlines_and_control_characters():
    assert safe("worker joined: x\nFORGED") == "worker joined: x\\nFORGED"
    assert safe("a\rb\x1b[2Jc\x00") == "a\\rb\\x1b[2Jc\\x00"
    assert "\n" not in safe("x\u2028y") and "\u2028" not in safe("x\u2028y")


def test_safe_bounds_length_and_says_how_much_is_cut():
    text = safe("e" * (1 << 20))
    assert text == "e" * 200 + f"... ({(1 << 20) - 200} more)"
    assert safe("short") == "short"
    assert safe("x" * 50, limit=10).endswith("... (40 more)")


def test_safe_shows_bytes_as_hex_and_other_values_as_text():
    assert safe(b"\x00\xffw") == "00ff77"
    assert safe(None) == "None"
    assert safe(ValueError("bad\nline")) == "bad\\nline"


def test_throttle_lets_a_burst_through_per_period_and_counts_the_rest():
    throttle = Throttle(burst=3, period=10.0)
    assert [throttle.allow(now=0.0) for _ in range(5)] == [True, True, True, False, False]
    assert throttle.take_suppressed() == 2 and throttle.take_suppressed() == 0
    assert throttle.allow(now=10.0)


def test_rate_limited_log_says_how_many_it_held_back(caplog):
    logger = logging.getLogger("infer.test.logsafe")
    warn = RateLimitedLog(logger, burst=2, period=3600.0)
    with caplog.at_level(logging.WARNING, logger="infer.test.logsafe"):
        for i in range(10):
            warn.warning("flood %d", i)
    assert [r.getMessage() for r in caplog.records] == ["flood 0", "flood 1"]
    warn.throttle._window_start = -1e9  # the next period
    with caplog.at_level(logging.WARNING, logger="infer.test.logsafe"):
        warn.warning("after")
    assert [r.getMessage() for r in caplog.records][-2:] == ["(8 similar warning(s) were not logged)", "after"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_setup_logging_writes_one_line_per_record(fmt):
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("INFO", fmt, stream=stream, force=True)
        logging.getLogger("infer.test.logs").warning("hello %s", "world")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("infer.test.logs").exception("failed")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    text = stream.getvalue()
    if fmt == "json":
        lines = [json.loads(line) for line in text.splitlines()]
        assert lines[0]["message"] == "hello world" and lines[0]["level"] == "WARNING"
        assert lines[0]["logger"] == "infer.test.logs" and "ts" in lines[0]
        assert lines[1]["message"] == "failed" and "RuntimeError: boom" in lines[1]["exc_info"]
        assert len(lines) == 2
    else:
        assert "WARNING infer.test.logs: hello world" in text.splitlines()[0]


def test_setup_logging_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="log format"):
        setup_logging("INFO", "xml")


@pytest.mark.parametrize(
    "module, argv",
    [
        ("infer.coordinator.daemon", []),
        ("infer.worker.service.cli", ["--coordinator", "tcp://127.0.0.1:5555"]),
        ("infer.client.serve", []),
        ("infer.client.api.server", ["--coordinator", "tcp://127.0.0.1:5555"]),
    ],
)
def test_every_command_takes_the_same_logging_flags(module, argv):
    import importlib

    parser = importlib.import_module(module).build_parser()
    args = parser.parse_args([*argv, "--log-format", "json", "--log-level", "debug"])
    assert (args.log_format, args.log_level) == ("json", "DEBUG")
    assert parser.parse_args(argv).log_format == "text"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--log-format", "xml"])


def test_child_processes_get_the_logging_flags_the_same_way():
    from infer.worker.service.cli import build_parser

    args = build_parser().parse_args(["--coordinator", "tcp://127.0.0.1:5555", *logging_argv("DEBUG", "json")])
    assert (args.log_level, args.log_format) == ("DEBUG", "json") and logging_flags(args) == logging_argv(
        "DEBUG", "json"
    )
