"""``AsyncClient``: the asyncio client, the calls of ``Calls`` awaiting each wait, with
fetching the tokenizer, and tokenizing long texts, kept off the event loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from mpengine.client.calls import Calls
from mpengine.client.requests import Batch
from mpengine.client.tokens import off_the_loop
from mpengine.client.waits import AsyncInbox, Awaiting, Wait, awaiting, awaiting_call
from mpengine.protocol import TokenizerQuery

T = TypeVar("T")


class AsyncClient(Calls, Awaiting, waits=awaiting):
    """asyncio client over the same connection machinery (the I/O thread hands deltas to
    the event loop each request was made from; one client may serve several loops, one
    after the other or at once). Arguments as for ``Client``."""

    _inbox = AsyncInbox
    _tokenizer_fetch: asyncio.Future | None = None  # a fetch under way

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    # -- off the event loop --------------------------------------------------------------

    def _prepare(
        self, texts: Sequence[object], work: Callable[[], Any], tokenizer: bool = False
    ) -> Wait:
        return functools.partial(self._prepared, texts, work, tokenizer)

    def _made(self, batch: Batch) -> Wait:
        # All made before any is submitted: their texts tokenized off the loop, at once.
        return self._prepare(batch.prompts, lambda: list(batch.made()))

    async def _prepared(self, texts: Sequence[object], work: Callable[[], T], tokenizer: bool) -> T:
        """``work()``, once the tokenizer is here if ``tokenizer`` or any of ``texts``
        (prompts) is text; in a worker thread when they hold much text."""
        if tokenizer or any(isinstance(text, str) for text in texts):
            await self._fetch_tokenizer()
        return await off_the_loop(texts, work)

    async def _fetch_tokenizer(self) -> None:
        """Fetch the tokenizer without blocking the event loop (``tokenize`` would); calls
        that come while it is on its way wait for that one fetch (the file can be megabytes)."""
        if self._text.tokenizer is not None:
            return
        fetch = self._tokenizer_fetch
        if fetch is None or fetch.get_loop() is not asyncio.get_running_loop():
            fetch = self._tokenizer_fetch = asyncio.ensure_future(
                self._aquery(TokenizerQuery, self._timeout)
            )
        try:
            reply = await asyncio.shield(fetch)
        finally:
            if fetch.done() and self._tokenizer_fetch is fetch:
                self._tokenizer_fetch = None  # a failed fetch is tried again by the next call
        self._text.adopt(reply)

    async def _aquery(self, make: Callable[[int], msgspec.Struct], timeout: float) -> Any:
        """Send ``make(query_id)`` and await the engine's reply."""
        return await awaiting_call(self._asked(make, timeout))
