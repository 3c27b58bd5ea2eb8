"""What the server logs of its requests: an access line per HTTP request (on by default;
``--disable-uvicorn-access-log``), and with ``--enable-log-requests`` each engine request's
parameters and prompt lengths (its text too, at ``--log-level debug``), as vLLM logs them.
Warnings that a client can cause at will (a malformed HTTP request is uvicorn's "Invalid
HTTP request received") pass :class:`RateLimit`: a flood of them is a few lines.

An access line is written when the answer is complete (a stream's last chunk sent, or the
client gone): ``CLIENT "METHOD PATH HTTP/VERSION" STATUS DURATIONms``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("mpengine.access")
request_logger = logging.getLogger("mpengine.requests")


class AccessLog:
    """ASGI middleware: one ``mpengine.access`` line per HTTP request, at INFO."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # unless an answer starts: the server's error handler answers 500

        async def watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watching)
        finally:
            client = scope.get("client")
            access_logger.info(
                '%s "%s %s HTTP/%s" %d %.1fms',
                f"{client[0]}:{client[1]}" if client else "-",
                scope.get("method", ""),
                scope.get("path", ""),
                scope.get("http_version", "1.1"),
                status,
                1e3 * (time.perf_counter() - start),
            )


def log_request(
    request_id: str,
    prompts: Sequence[Sequence[int] | str],
    params: msgspec.Struct,
    decode: Callable[[list[int]], str],
) -> None:
    """One ``mpengine.requests`` line for an engine request (``--enable-log-requests``): its
    parameters and prompt lengths (in tokens; in characters for a text not yet tokenized);
    at DEBUG each prompt's text as well."""
    lengths = ", ".join(
        f"{len(prompt)} chars" if isinstance(prompt, str) else str(len(prompt))
        for prompt in prompts
    )
    params_json = msgspec.json.encode(params).decode()
    request_logger.info("request %s: prompts %s, params %s", request_id, lengths, params_json)
    if request_logger.isEnabledFor(logging.DEBUG):
        for index, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else decode(list(prompt))
            request_logger.debug("request %s prompt %d: %r", request_id, index, text)


class RateLimit(logging.Filter):
    """Lets through at most ``burst`` records of one message (its format string) every
    ``window`` seconds; the first one after a window says how many were dropped in it."""

    def __init__(
        self, burst: int = 5, window: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self.seen: dict[str, tuple[float, int, int]] = {}  # msg -> (window start, passed, dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        key = str(record.msg)
        start, passed, dropped = self.seen.get(key, (now, 0, 0))
        if now - start >= self.window:
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like it in the last {self.window:g} s)"
            start, passed, dropped = now, 0, 0
        if passed >= self.burst:
            self.seen[key] = (start, passed, dropped + 1)
            return False
        if len(self.seen) >= 1024 and key not in self.seen:  # (messages are format strings)
            self.seen.clear()
        self.seen[key] = (start, passed + 1, dropped)
        return True
