"""The calls of ``Client`` and ``AsyncClient``, each written once, as steps (``waits``):
``Client`` blocks on them, ``AsyncClient`` awaits them. What a facade adds is how it waits:
its inbox, and whether it prepares requests (tokenizes, renders chat templates) inline or
off the event loop."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpengine.client.base import ClientBase, Prompt, chats, one_chat
from mpengine.client.outputs import EmbeddingOutput, RequestOutput
from mpengine.client.requests import Batch, Request, cancel, query_steps
from mpengine.client.sockets import Deadline
from mpengine.client.tokens import ChatOptions, Conversation
from mpengine.client.waits import (
    AsyncInbox,
    Emit,
    Inbox,
    Spec,
    Steps,
    StreamSteps,
    Wait,
    call,
    streams,
)
from mpengine.protocol import EngineStats, PoolingParams, SamplingParams, StatsQuery


def _texts(conversations: list) -> list[str]:
    """The text of conversations' messages, as far as they are dicts (to measure it)."""
    from mpengine.chat_template import message_texts

    messages = [
        m for c in conversations if isinstance(c, Sequence) for m in c if isinstance(m, Mapping)
    ]
    return message_texts(messages)


class Calls(ClientBase):
    """Every call of a client, once. A facade names how its calls wait (``class
    Client(Calls, waits=blocking)``: it gets a method of each) and says how it makes what
    they wait for: ``_inbox``, ``_prepare`` and ``_made``."""

    _inbox: Callable[[], Inbox | AsyncInbox]

    def __init_subclass__(
        cls, *, waits: Callable[[Spec], Callable[..., Any]] | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if waits is None:  # (a subclass of a facade keeps its methods)
            return
        for name, spec in vars(Calls).items():
            if isinstance(spec, call | streams):
                setattr(cls, name, waits(spec))

    def _prepare(
        self, texts: Sequence[object], work: Callable[[], Any], tokenizer: bool = False
    ) -> Wait:
        """A wait for ``work()`` (a request made, conversations rendered), which needs the
        tokenizer if ``tokenizer`` or any of ``texts`` (prompts) is text, and takes long
        when they hold much text."""
        raise NotImplementedError

    def _made(self, batch: Batch) -> Wait:
        """A wait for the batch's requests, made: an iterable of them."""
        raise NotImplementedError

    # -- the calls -----------------------------------------------------------------------

    @streams
    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> StreamSteps[RequestOutput]:
        """Yield each delta as the engine produces it (the last has ``finished``).
        Closing the stream, or ``timeout`` seconds passing (``TimeoutError``), aborts the
        request: leaving a ``for`` loop over ``client.stream(...)`` early closes it; a stream
        kept in a variable is closed by ``.close()`` (``AsyncClient``'s: ``aclose()``; or
        ``contextlib.closing``, ``aclosing``), else only when it is collected (as is one
        that an ``async for`` leaves early). ``priority``: lower runs first, when the engine
        schedules by priority. ``tenant``: whose share of the engine the request uses
        (None: this client's); a front end serving many users names each (the engine
        shares its sequences fairly between tenants, ``scheduler/waiting.py``).
        ``data_parallel_rank``: the replica of a data-parallel engine that runs it (None:
        the client's router chooses); every call takes it."""
        return self._deltas(
            prompt, params, request_id, timeout, priority, tenant, data_parallel_rank
        )

    @call
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> Steps[RequestOutput]:
        """Run one request to completion; after ``timeout`` seconds abort it and raise
        ``TimeoutError``."""
        batch = self._generations(
            [prompt], params, [request_id], priority, tenant, data_parallel_rank
        )
        (out,) = yield from self._finished(batch, timeout)
        return out

    @call
    def generate_many(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
        request_ids: Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
        tenant: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> Steps[list[RequestOutput]]:
        """Submit every prompt at once (so they batch); return the outputs in order. After
        ``timeout`` seconds (for all of them) abort the unfinished and raise ``TimeoutError``.
        ``priority``: one for all, or one per prompt (lower runs first, when the engine
        schedules by priority)."""
        batch = self._generations(
            prompts, params, request_ids, priority, tenant, data_parallel_rank
        )
        return self._finished(batch, timeout)

    @call
    def apply_chat_template(
        self,
        messages: Conversation,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Steps[list[int]]:
        """The token ids ``chat`` sends for one conversation (arguments as for ``chat``)."""
        (ids,) = yield self._rendered([messages], ChatOptions.of(locals()))
        return ids

    @call
    def chat(
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
        tenant: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> Steps[RequestOutput | list[RequestOutput]]:
        """The model's reply to a conversation, as vLLM's ``LLM.chat``.

        ``messages``: one conversation, a list of ``{"role": ..., "content": ...}`` dicts
        (content as text or OpenAI's text parts; ``tool_calls``, ``reasoning_content``...
        reach the template as the HTTP server passes them), rendered by the model's chat
        template (``chat_template``: another one, its text or a file) and run as
        ``generate`` runs a prompt; or a list of conversations, run at once (so they batch),
        their outputs returned in order (``params``: one for all, or one per conversation;
        ``request_id`` only for one). ``add_generation_prompt``: end the prompt with the
        assistant's turn header; ``continue_final_message``: have the model continue the
        last message instead (no generation prompt then); ``chat_template_kwargs``: more
        template variables (``enable_thinking``...; an ``add_generation_prompt`` there wins);
        ``tools``: rendered by tool-use templates. A conversation the template cannot render
        raises ``InvalidRequestError``. After ``timeout`` seconds abort and raise
        ``TimeoutError``."""
        conversations, batch = chats(messages, request_id)
        prompts = yield self._rendered(conversations, ChatOptions.of(locals()))
        ids = [request_id] * len(prompts)
        made = self._generations(prompts, params, ids, priority, tenant, data_parallel_rank)
        outs = yield from self._finished(made, timeout)
        return outs if batch else outs[0]

    @streams.eagerly
    def chat_stream(
        self,
        messages: Conversation,
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> StreamSteps[RequestOutput]:
        """The reply to one conversation (arguments as for ``chat``), as ``stream`` yields a
        prompt's: each delta as the engine produces it; closing the stream aborts the
        request. ``Client`` renders the conversation at the call (one the template cannot
        render raises there, before any iteration), ``AsyncClient`` at the first one."""
        conversations = one_chat(messages)
        (ids,) = yield self._rendered(conversations, ChatOptions.of(locals()))
        yield from self._deltas(
            ids, params, request_id, timeout, priority, tenant, data_parallel_rank
        )

    @call
    def embed_many(
        self,
        prompts: Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        timeout: float | None = None,
        request_ids: Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
        tenant: str | None = None,
        on_output: Callable[[int, EmbeddingOutput], object] | None = None,
        data_parallel_rank: int | None = None,
    ) -> Steps[list[EmbeddingOutput]]:
        """Submit every input at once (so they batch); return the embeddings in order. A bad
        input raises ``InvalidRequestError`` (the others are aborted). ``on_output(index,
        embedding)`` is called for each input as it finishes, in finishing order (progress
        of a long batch, or what was done when the call fails part-way)."""
        batch = self._embeddings(
            prompts, params, request_ids, priority, on_output, tenant, data_parallel_rank
        )
        return self._finished(batch, timeout)

    @call
    def embed(
        self,
        prompt: Prompt,
        params: PoolingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> Steps[EmbeddingOutput]:
        """The embedding of one text (or token ids); ``params`` default to the model's
        pooling. After ``timeout`` seconds abort it and raise ``TimeoutError``."""
        batch = self._embeddings(
            [prompt], params, [request_id], priority, None, tenant, data_parallel_rank
        )
        (out,) = yield from self._finished(batch, timeout)
        return out

    @call
    def stats(
        self, timeout: float = 10.0, *, data_parallel_rank: int | None = None
    ) -> Steps[EngineStats]:
        """The scheduler's counters: queues, free blocks, preemptions... Of a data-parallel
        engine: every serving replica's added up (each one's stages named ``STAGE dpN``),
        or those of the replica ``data_parallel_rank``."""
        return self._asked(StatsQuery, timeout, data_parallel_rank)

    # -- what the calls wait for ---------------------------------------------------------

    def _deltas(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
        priority: int,
        tenant: str | None,
        rank: int | None,
    ) -> StreamSteps[RequestOutput]:
        """A streamed request's deltas, until it finishes; aborted if the stream stops
        first."""
        deadline = Deadline(timeout)
        inbox = self._inbox()
        make = functools.partial(
            self._request, prompt, params, request_id, priority, streaming=True, tenant=tenant
        )
        request = Request(self._conn, (yield self._prepare([prompt], make)), inbox.put, 0, rank)
        try:
            while not request.finished:
                _, item = yield functools.partial(inbox.get, deadline, request.expect(deadline))
                if (delta := request.take(item)) is not None:
                    yield Emit(delta)
        finally:
            cancel([request])

    def _finished(self, batch: Batch, timeout: float | None) -> Steps[list]:
        """Make the batch's requests (as the facade makes them), submit them as the window
        admits them and wait for every one's end (one deadline for all)."""
        deadline = Deadline(timeout)
        inbox = self._inbox()
        made = yield self._made(batch)
        return (yield from batch.steps(self._conn, made, inbox, deadline))

    def _rendered(self, conversations: list, options: ChatOptions) -> Wait:
        """A wait for each conversation's token ids, rendered by the chat template."""

        def render() -> list[list[int]]:
            return [self._chat_ids(conversation, options) for conversation in conversations]

        return self._prepare(_texts(conversations), render, tokenizer=True)

    def _asked(
        self, make: Callable[[int], Any], timeout: float, rank: int | None = None
    ) -> Steps[Any]:
        """The engine's reply to the query ``make(query_id)`` (``rank``: one replica's)."""
        return query_steps(self._conn, make, self._inbox(), Deadline(timeout), rank)
