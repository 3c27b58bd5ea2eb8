"""uvicorn's h11 protocol with a deadline on each request's head.

uvicorn times out a keep-alive connection that sends nothing, but not one that sends a byte
now and then: a client sending its headers a byte every 2 s held its connection for as
long as it liked (5,000 such clients exhaust the server's descriptors). Here the request
line and headers must arrive within ``head_timeout`` seconds of the connection (or of the
previous response); past it the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class _HeadDeadline(H11Protocol):
    head_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def _await_head(self) -> None:
        """Start waiting for the next request's head (the request now is ``self.cycle``)."""
        self._waiting_after = self.cycle
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_deadline is not None and self.cycle is not self._waiting_after:
            self._head_deadline.cancel()  # a request's head came in
            self._head_deadline = None

    def on_response_complete(self) -> None:
        if self._head_deadline is None:
            self._await_head()  # (before: a pipelined request handled next cancels it)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            logger.debug("a request's head took over %g s: connection closed", self.head_timeout)
            self.transport.close()


def protocol_with_head_timeout(seconds: float) -> type[H11Protocol]:
    """The protocol class for uvicorn's ``http=``, with heads due within ``seconds``."""
    return type("HeadDeadlineH11", (_HeadDeadline,), {"head_timeout": seconds})
