"""``AsyncClient``: the asyncio client, a thin layer over ``ClientBase`` that awaits an
``AsyncInbox`` and keeps fetching the tokenizer, and tokenizing long texts, off the event
loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import msgspec

from mpengine.client.base import ClientBase, Prompt, chats, one_chat
from mpengine.client.outputs import EmbeddingOutput, RequestOutput
from mpengine.client.requests import AsyncInbox, Batch, Request, cancel, query_steps
from mpengine.client.sockets import Deadline
from mpengine.client.tokens import ChatOptions, Conversation, off_the_loop
from mpengine.protocol import (
    EngineStats,
    PoolingParams,
    SamplingParams,
    StatsQuery,
    TokenizerQuery,
)

T = TypeVar("T")


def _texts(conversations: list) -> list[str]:
    """The text of conversations' messages, as far as they are dicts (to measure it)."""
    from mpengine.chat_template import message_texts

    messages = [
        m for c in conversations if isinstance(c, Sequence) for m in c if isinstance(m, Mapping)
    ]
    return message_texts(messages)


class AsyncClient(ClientBase):
    """asyncio client over the same connection machinery (the I/O thread hands deltas to
    the event loop each request was made from; one client may serve several loops, one
    after the other or at once). Arguments as for ``Client``."""

    _tokenizer_fetch: asyncio.Future | None = None  # a fetch under way

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield each delta as the engine produces it. Closing the generator (``aclose()``,
        ``contextlib.aclosing``; leaving an ``async for`` early leaves it to the collector),
        or ``timeout`` seconds passing (``TimeoutError``), aborts the request."""
        deadline = Deadline(timeout)
        inbox = AsyncInbox()
        add = await self._prepared(
            [prompt], lambda: self._request(prompt, params, request_id, priority, streaming=True)
        )
        request = Request(self._conn, add, inbox.put)
        try:
            while not request.finished:
                _, item = await inbox.get(deadline, request.expect(deadline))
                yield request.take(item)
        finally:
            cancel([request])

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        """Run one request to completion; after ``timeout`` seconds abort it and raise
        ``TimeoutError``."""
        batch = self._generations([prompt], params, [request_id], priority)
        (out,) = await self._run(batch, timeout)
        return out

    async def generate_many(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
        request_ids: Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Submit every prompt at once (so they batch); return the outputs in order. After
        ``timeout`` seconds (for all of them) abort the unfinished and raise ``TimeoutError``.
        ``priority``: one for all, or one per prompt (lower runs first, when the engine
        schedules by priority)."""
        batch = self._generations(prompts, params, request_ids, priority)
        return await self._run(batch, timeout)

    @overload
    async def chat(
        self, messages: Conversation, params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestOutput: ...

    @overload
    async def chat(
        self,
        messages: Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]: ...

    async def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> RequestOutput | list[RequestOutput]:
        """The model's reply to a conversation, or the replies to a batch of them, as
        ``Client.chat`` (the same arguments)."""
        conversations, batch = chats(messages, request_id)
        options = ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        prompts = await self._chat_prompts(conversations, options)
        requests = self._generations(prompts, params, [request_id] * len(prompts), priority)
        outs = await self._run(requests, timeout)
        return outs if batch else outs[0]

    async def chat_stream(
        self,
        messages: Conversation,
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """The reply to one conversation (arguments as for ``chat``), as ``stream`` yields a
        prompt's; closing the generator aborts the request."""
        conversations = one_chat(messages)
        options = ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        (ids,) = await self._chat_prompts(conversations, options)
        deltas = self.stream(ids, params, request_id=request_id, timeout=timeout, priority=priority)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta

    async def embed(
        self,
        prompt: Prompt,
        params: PoolingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> EmbeddingOutput:
        """The embedding of one text (or token ids); after ``timeout`` seconds abort it and
        raise ``TimeoutError``."""
        (out,) = await self._run(
            self._embeddings([prompt], params, [request_id], priority, None), timeout
        )
        return out

    async def embed_many(
        self,
        prompts: Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        timeout: float | None = None,
        request_ids: Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
        on_output: Callable[[int, EmbeddingOutput], object] | None = None,
    ) -> list[EmbeddingOutput]:
        """Submit every input at once (so they batch); return the embeddings in order.
        ``on_output(index, embedding)`` is called for each input as it finishes, in finishing
        order (progress of a long batch, or what was done when the call fails part-way)."""
        return await self._run(
            self._embeddings(prompts, params, request_ids, priority, on_output), timeout
        )

    async def stats(self, timeout: float = 10.0) -> EngineStats:
        """The scheduler's counters: queues, free blocks, preemptions..."""
        return await self._aquery(StatsQuery, timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- off the event loop --------------------------------------------------------------

    async def _run(self, batch: Batch, timeout: float | None) -> list:
        """Make the batch's requests (texts tokenized off the loop), then submit them as
        the window admits them and await every one's end (one deadline for all)."""
        deadline = Deadline(timeout)
        inbox = AsyncInbox()
        made = await self._prepared(batch.prompts, lambda: list(batch.made()))
        return await inbox.run(batch.steps(self._conn, made, inbox.put), deadline)

    async def _chat_prompts(self, conversations: list, options: ChatOptions) -> list[list[int]]:
        """Each conversation rendered by the chat template, off the event loop when long."""
        return await self._prepared(
            _texts(conversations),
            lambda: [self._chat_ids(c, options) for c in conversations],
            tokenizer=True,
        )

    async def _prepared(
        self, texts: Sequence[object], work: Callable[[], T], tokenizer: bool = False
    ) -> T:
        """``work()`` (requests made, conversations rendered), once the tokenizer is here
        if ``tokenizer`` or any of ``texts`` (prompts) is text; in a worker thread when they
        hold much text."""
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
        inbox = AsyncInbox()
        return await inbox.run(query_steps(self._conn, make, inbox.put), Deadline(timeout))
