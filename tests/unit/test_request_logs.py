"""The server's request logs: an access line per HTTP request once its answer is complete,
and (``--enable-log-requests``) a line per engine request."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mpengine.protocol import SamplingParams
from mpengine.server.request_logs import AccessLog, RateLimit, log_request

SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "http_version": "1.1",
    "client": ("127.0.0.1", 5000),
}


async def _receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def run(app) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(AccessLog(app)(dict(SCOPE), _receive, send))
    return sent


def test_one_access_line_per_request_with_status_and_duration(caplog) -> None:
    async def streamed(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        for chunk in (b"a", b"b"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with caplog.at_level(logging.INFO, logger="mpengine.access"):
        sent = run(streamed)
    assert len(sent) == 4  # the answer passes through untouched
    (record,) = [r for r in caplog.records if r.name == "mpengine.access"]
    line = record.getMessage()
    assert line.startswith('127.0.0.1:5000 "POST /v1/completions HTTP/1.1" 201 ')
    assert line.endswith("ms") and float(line.split()[-1].removesuffix("ms")) >= 0


def test_a_request_that_fails_is_logged_as_500(caplog) -> None:
    async def broken(scope, receive, send) -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.INFO, logger="mpengine.access"), pytest.raises(RuntimeError):
        run(broken)
    assert '"POST /v1/completions HTTP/1.1" 500 ' in caplog.records[-1].getMessage()


def test_engine_requests_log_their_parameters_and_lengths_and_text_only_at_debug(caplog) -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5)
    with caplog.at_level(logging.INFO, logger="mpengine.requests"):
        log_request("cmpl-1", [[1, 2, 3], [4, 5]], params, lambda ids: f"text of {ids}")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("request cmpl-1: prompts 3, 2, params {")
    assert '"max_tokens":7' in line and '"temperature":0.5' in line
    assert "text of" not in line
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="mpengine.requests"):
        log_request("embd-1", ["some words", [9]], params, lambda ids: f"text of {ids}")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("request embd-1: prompts 10 chars, 1, params")
    assert lines[1:] == [
        "request embd-1 prompt 0: 'some words'",
        "request embd-1 prompt 1: 'text of [9]'",
    ]


def test_a_flood_of_one_warning_is_a_few_lines() -> None:
    """2,000 malformed requests logged 2,000 warnings in 1.2 s: a message passes a few times
    a window, and the first after it counts what was dropped."""
    now = [0.0]
    limit = RateLimit(burst=3, window=10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, msg, None, None)

    passed = [
        r
        for r in (record("Invalid HTTP request received.") for _ in range(2000))
        if limit.filter(r)
    ]
    assert len(passed) == 3
    assert limit.filter(record("another message"))  # each message has its own budget
    now[0] = 10.0
    late = record("Invalid HTTP request received.")
    assert limit.filter(late)
    assert (
        late.getMessage() == "Invalid HTTP request received. (1997 more like it in the last 10 s)"
    )
