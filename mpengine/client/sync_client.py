"""``Client``: the blocking client, a thin layer over ``ClientBase`` that waits in an
``Inbox``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

from mpengine.client.base import ClientBase, Prompt, chats, one_chat
from mpengine.client.outputs import EmbeddingOutput, RequestOutput
from mpengine.client.requests import Batch, Inbox, Request, cancel
from mpengine.client.sockets import Deadline
from mpengine.client.tokens import ChatOptions, Conversation
from mpengine.protocol import EngineStats, PoolingParams, SamplingParams, StatsQuery


class Client(ClientBase):
    """Blocking client. Thread-safe: many threads may generate at once.

    ``address``: the engine's request address (``engine.address``; ``ipc://...`` or
    ``tcp://host:port``). ``timeout``: seconds for the handshake (and tokenizer fetch).
    ``client_id``: a name for the client in logs (default: random); each connection routes
    under it plus a nonce of its own, so clients may share a name.
    ``auth_token``: the engine's ``auth_token``, if it has one.
    """

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Iterator[RequestOutput]:
        """Yield each delta as the engine produces it (the last has ``finished``).
        Closing the generator, or ``timeout`` seconds passing (``TimeoutError``), aborts
        the request: leaving a ``for`` loop over ``client.stream(...)`` early closes it; a
        generator kept in a variable is closed by ``.close()`` (or ``contextlib.closing``),
        else only when it is collected. ``priority``: lower runs first, when the engine
        schedules by priority."""
        deadline = Deadline(timeout)
        inbox = Inbox()
        add = self._request(prompt, params, request_id, priority, streaming=True)
        request = Request(self._conn, add, inbox.put)
        try:
            while not request.finished:
                _, item = inbox.get(deadline, request.expect(deadline))
                yield request.take(item)
        finally:
            cancel([request])

    def generate(
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
        (out,) = self._run(self._generations([prompt], params, [request_id], priority), timeout)
        return out

    def generate_many(
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
        return self._run(self._generations(prompts, params, request_ids, priority), timeout)

    def apply_chat_template(
        self,
        messages: Conversation,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids ``chat`` sends for one conversation (arguments as for ``chat``)."""
        options = ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        return self._chat_ids(messages, options)

    @overload
    def chat(
        self, messages: Conversation, params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestOutput: ...

    @overload
    def chat(
        self,
        messages: Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]: ...

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
    ) -> RequestOutput | list[RequestOutput]:
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
        options = ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        prompts = [self._chat_ids(conversation, options) for conversation in conversations]
        ids = [request_id] * len(prompts)
        outs = self._run(self._generations(prompts, params, ids, priority), timeout)
        return outs if batch else outs[0]

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
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Iterator[RequestOutput]:
        """The reply to one conversation (arguments as for ``chat``), as ``stream`` yields a
        prompt's: each delta as the engine produces it; closing the iterator aborts the
        request. The conversation is rendered now: one the template cannot render raises
        here, before any iteration."""
        (conversation,) = one_chat(messages)
        options = ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        ids = self._chat_ids(conversation, options)
        return self.stream(ids, params, request_id=request_id, timeout=timeout, priority=priority)

    def embed(
        self,
        prompt: Prompt,
        params: PoolingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> EmbeddingOutput:
        """The embedding of one text (or token ids); ``params`` default to the model's
        pooling. After ``timeout`` seconds abort it and raise ``TimeoutError``."""
        batch = self._embeddings([prompt], params, [request_id], priority, None)
        (out,) = self._run(batch, timeout)
        return out

    def embed_many(
        self,
        prompts: Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        timeout: float | None = None,
        request_ids: Sequence[str | None] | None = None,
        priority: int | Sequence[int] = 0,
        on_output: Callable[[int, EmbeddingOutput], object] | None = None,
    ) -> list[EmbeddingOutput]:
        """Submit every input at once (so they batch); return the embeddings in order. A bad
        input raises ``InvalidRequestError`` (the others are aborted). ``on_output(index,
        embedding)`` is called for each input as it finishes, in finishing order (progress
        of a long batch, or what was done when the call fails part-way)."""
        batch = self._embeddings(prompts, params, request_ids, priority, on_output)
        return self._run(batch, timeout)

    def stats(self, timeout: float = 10.0) -> EngineStats:
        """The scheduler's counters: queues, free blocks, preemptions..."""
        return self._query(StatsQuery, timeout)

    def _run(self, batch: Batch, timeout: float | None) -> list:
        """Submit the batch's requests, each made (its text tokenized) as the window
        admits it, and block until every one has finished (one deadline for all)."""
        deadline = Deadline(timeout)
        inbox = Inbox()
        return inbox.run(batch.steps(self._conn, batch.made(), inbox.put), deadline)
