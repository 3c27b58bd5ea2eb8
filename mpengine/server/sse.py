"""Server-sent events: ``data: {json}`` per chunk, ``data: [DONE]`` at the end.

A streaming response starts (status 200, headers) only once the first output arrived, so a
request the engine refuses at once (overloaded, invalid) gets its proper status and JSON
error instead of an event stream. An error after that point is sent as an event with
OpenAI's error shape (which the ``openai`` package raises), followed by ``[DONE]``.

A client that stops reading a stream would have its outputs pile up in the server (7.7 MB
a stream was seen): a write that waits ``--stream-stall-timeout`` seconds for the client
ends the stream and aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from mpengine.client.outputs import RequestOutput
from mpengine.server.errors import APIError, error_type
from mpengine.server.generation import Generation, until_disconnected
from mpengine.server.schemas import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode

Item = tuple[int, RequestOutput]


def event(chunk: msgspec.Struct) -> bytes:
    return b"data: " + _encode(chunk) + b"\n\n"


async def stream_response(
    request: Request,
    generation: Generation,
    chunks: Callable[[Item], AsyncIterator[bytes]],
) -> StreamingResponse:
    """Wait for the first output (a refusal raises ``APIError`` here), then stream
    ``chunks(first)``. However the stream ends, the generation is closed (aborting what
    still runs, when the client went away)."""
    try:
        first = await until_disconnected(request, generation.next())
    except BaseException:
        await generation.close()
        raise
    if first is None:  # cannot happen: every request yields at least its final output
        await generation.close()
        raise APIError(500, "the engine finished without output")

    async def body() -> AsyncIterator[bytes]:
        try:
            async for data in chunks(first):
                yield data
                # Outputs that arrived together would go out without a suspension between
                # them, so a connection lost at the first write would not be noticed (the
                # server learns of it in a callback of the next loop turn): asyncio then
                # logs "socket.send() raised exception." for each write past the fifth.
                await asyncio.sleep(0)
        except APIError as exc:
            info = ErrorInfo(exc.message, error_type(exc.status), exc.param, exc.code or exc.status)
            yield event(ErrorResponse(info))
            yield DONE
        finally:
            await generation.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _StallBounded(
        body(), generation.state.stream_stall_s, media_type="text/event-stream", headers=headers
    )


class _Stalled(Exception):
    pass


class _StallBounded(StreamingResponse):
    """A streaming response whose every write may wait ``stall_s`` seconds for the client;
    past that the stream ends (its body closed: the generation aborted)."""

    def __init__(self, content: AsyncIterator[bytes], stall_s: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stall_s = stall_s

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_s)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().stream_response(bounded)
        except _Stalled:
            logger.info("a client read nothing of its stream for %g s: aborted", self.stall_s)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
