"""What ``Client`` and ``AsyncClient`` share below their calls (``calls``): one
connection, what the engine shared for text (its tokenizer and chat template), the
building and checking of requests, and the client's lifetime."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from mpengine.client.connection import Connection, after_fork
from mpengine.client.outputs import EmbeddingOutput
from mpengine.client.replicas import Replicas, addresses_of
from mpengine.client.requests import Batch, Request, query_steps
from mpengine.client.routing import Policy
from mpengine.client.sockets import Deadline
from mpengine.client.tokens import ChatOptions, Conversation, EngineText, token_array
from mpengine.client.waits import Inbox, blocking_call
from mpengine.errors import InvalidRequestError
from mpengine.protocol import (
    INT32_MAX,
    MAX_REQUEST_ID,
    AddRequest,
    EngineInfo,
    PoolingParams,
    SamplingParams,
    TokenizerQuery,
)

Prompt = str | Sequence[int]
T = TypeVar("T")


def _priorities(priority: int | Sequence[int], count: int) -> list[int]:
    """One priority per prompt: the same for all, or a sequence of them (each is checked
    where its request is made)."""
    one = not isinstance(priority, Sequence) or isinstance(priority, str | bytes)
    priorities = [priority] * count if one else list(priority)  # type: ignore[arg-type]
    if len(priorities) != count:
        raise ValueError(f"{count} prompts and {len(priorities)} priorities: give one per prompt")
    return priorities


def _tenant(tenant: str | None) -> str:
    """A tenant's name as requests carry it ("": the client's own share)."""
    if tenant is None:
        return ""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
    if len(tenant) > MAX_REQUEST_ID:
        raise InvalidRequestError(f"tenant: at most {MAX_REQUEST_ID} characters, got {len(tenant)}")
    return tenant


def _check_priority(priority: object) -> None:
    in_range = isinstance(priority, int) and -INT32_MAX - 1 <= priority <= INT32_MAX
    if not in_range or isinstance(priority, bool):
        raise InvalidRequestError(f"priority ({priority!r}) must be an integer within int32")


def _per_prompt(params: Any, kind: type, count: int) -> list:
    """One parameter set per prompt: the same one for all (None: each request's default),
    or a sequence of them."""
    if params is None or isinstance(params, kind):
        return [params] * count
    if isinstance(params, dict | str | bytes):  # would iterate as keys or characters
        raise TypeError(
            f"params must be {kind.__name__} (or one per prompt), not {type(params).__name__}"
        )
    return list(params)


def _conversations(messages: Conversation | Sequence[Conversation]) -> tuple[list, bool]:
    """The conversations of ``chat``'s argument (one, or a batch: a list of them), and
    whether it was a batch."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            "messages: a list of {'role': ..., 'content': ...} dicts, or a list of such lists"
        )
    batch = bool(messages) and all(
        isinstance(m, Sequence) and not isinstance(m, str | bytes) for m in messages
    )
    return (list(messages) if batch else [messages]), batch


def chats(
    messages: Conversation | Sequence[Conversation], request_id: str | None
) -> tuple[list, bool]:
    """``chat``'s conversations and whether they are a batch (``request_id`` names one
    conversation's request: a batch's get fresh ids)."""
    conversations, batch = _conversations(messages)
    if batch and request_id is not None:
        raise TypeError("request_id names one request: a batch of conversations gets fresh ids")
    return conversations, batch


def one_chat(messages: Conversation | Sequence[Conversation]) -> list:
    """``chat_stream``'s conversation (a batch is refused), in a list."""
    conversations, batch = _conversations(messages)
    if batch:
        raise InvalidRequestError("chat_stream takes one conversation, not a batch")
    return conversations


class ClientBase:
    """A client's connection and everything of its calls but the waiting."""

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout: float = 30.0,
        client_id: str | None = None,
        auth_token: str | None = None,
        routing: Policy = "least_outstanding",
    ) -> None:
        addresses = addresses_of(address)
        self._conn: Connection | Replicas
        if isinstance(address, str) and len(addresses) == 1:  # one engine
            self._conn = Connection(
                addresses[0], timeout=timeout, client_id=client_id, auth_token=auth_token
            )
        else:
            self._conn = Replicas(
                addresses,
                timeout=timeout,
                client_id=client_id,
                auth_token=auth_token,
                routing=routing,
            )
        self._timeout = timeout
        self._text = EngineText()  # fetched from the engine on first use
        self._tokenizer_lock = threading.Lock()
        after_fork.add(self)
        self._ids = itertools.count()
        # Dropped without close(): the I/O thread aborts what is pending and stops. (The
        # finalizer holds the connection, never this object.)
        weakref.finalize(self, self._conn.abandon)

    def _new_locks(self) -> None:
        self._tokenizer_lock = threading.Lock()

    @property
    def info(self) -> EngineInfo:
        """What the engine said about itself at the handshake."""
        return self._conn.info

    @property
    def client_id(self) -> str:
        return self._conn.client_id

    @property
    def data_parallel_size(self) -> int:
        """The engine's replicas this client routes requests between."""
        return len(self._conn.replicas) if isinstance(self._conn, Replicas) else 1

    def replica_problems(self) -> list[str | None]:
        """Why each replica does not take requests now (None for one that does)."""
        if isinstance(self._conn, Replicas):
            return [problem for _, problem in self._conn.status()]
        return [self._conn.problem()]

    def tokenize(self, text: str, *, max_length: int | None = None) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (fetched from the engine once
        per client, so this works from any host), special tokens added as the model's
        tokenizer frames an input. ``max_length`` truncates the text's tokens so that the
        framed whole fits (as ``transformers``' ``truncation=True``)."""
        return self._fetched().tokenize(text, max_length)

    def _fetched(self) -> EngineText:
        """What the engine shares for text, fetched (blocking) on first use."""
        if self._text.tokenizer is None:
            with self._tokenizer_lock:
                if self._text.tokenizer is None:
                    self._text.adopt(self._query(TokenizerQuery, self._timeout))
        return self._text

    def _chat_ids(self, conversation: Conversation, options: ChatOptions) -> list[int]:
        return self._fetched().chat_ids(conversation, options)

    def _query(self, make: Callable[[int], msgspec.Struct], timeout: float) -> Any:
        """Send ``make(query_id)`` and block for the engine's reply."""
        return blocking_call(query_steps(self._conn, make, Inbox(), Deadline(timeout)))

    # -- requests, built and checked -----------------------------------------------------

    def _request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int = 0,
        streaming: bool = False,
        tenant: str | None = None,
    ) -> AddRequest:
        # No parameters: the model's defaults (its generation_config.json), as vLLM's.
        params = (params or self.info.default_sampling()).validate()
        _check_priority(priority)
        if streaming and not params.streams:
            what = (
                "beam search"
                if params.use_beam_search
                else f"best_of ({params.best_of}) > n ({params.n})"
            )
            raise InvalidRequestError(
                f"{what} cannot be streamed: the best samples are known only when all have ended"
            )
        ids = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        # Truncated here too, so that the output's prompt_token_ids are what ran.
        ids = params.truncated(ids, self.info.max_model_len)
        request_id = self._request_id(request_id)
        return AddRequest(
            request_id,
            token_array(ids),
            params,
            arrival_time=time.time(),
            priority=priority,
            tenant=_tenant(tenant),
        )

    def _request_id(self, request_id: str | None) -> str:
        """``request_id``, or a fresh one of this client's when None (or empty)."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, not {type(request_id).__name__}")
        if request_id is not None and len(request_id) > MAX_REQUEST_ID:
            raise InvalidRequestError(
                f"request_id: at most {MAX_REQUEST_ID} characters, got {len(request_id)}"
            )
        return request_id or f"{self.client_id}-{next(self._ids)}"

    def _embed_request(
        self,
        prompt: Prompt,
        params: PoolingParams | None,
        request_id: str | None,
        priority: int = 0,
    ) -> AddRequest:
        params = (params or PoolingParams()).validate()
        _check_priority(priority)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidRequestError("the input is empty (or only whitespace)")
            limit = params.truncate_prompt_tokens
            if limit is not None:  # as the engine truncates ids: at most max_model_len
                most = self.info.max_model_len
                limit = most if limit == -1 else min(limit, most)
            prompt = self.tokenize(prompt, max_length=limit)
        request_id = self._request_id(request_id)
        return AddRequest(
            request_id,
            token_array(prompt),
            pooling=params,
            arrival_time=time.time(),
            priority=priority,
        )

    def _generations(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        request_ids: Sequence[str | None] | None,
        priority: int | Sequence[int],
        tenant: str | None = None,
        rank: int | None = None,
    ) -> Batch:
        """``generate_many``'s batch: each prompt's ``RequestOutput``."""
        make, result = self._request, Request.output
        batch = self._batch(make, SamplingParams, result, prompts, params, request_ids, priority)
        batch.tenant, batch.rank = _tenant(tenant), rank
        return batch

    def _embeddings(
        self,
        prompts: Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None,
        request_ids: Sequence[str | None] | None,
        priority: int | Sequence[int],
        on_output: Callable[[int, EmbeddingOutput], object] | None,
        tenant: str | None = None,
        rank: int | None = None,
    ) -> Batch:
        """``embed_many``'s batch: each input's ``EmbeddingOutput``, each passed to
        ``on_output(index, embedding)`` as it finishes."""
        make, result = self._embed_request, Request.embedding
        batch = self._batch(make, PoolingParams, result, prompts, params, request_ids, priority)
        batch.tenant, batch.rank = _tenant(tenant), rank
        if on_output is not None:
            batch.finished = lambda request: on_output(request.index, request.embedding())
        return batch

    def _batch(
        self,
        make: Callable[..., AddRequest],
        kind: type,
        result: Callable[[Request], Any],
        prompts: Sequence[Prompt],
        params: Any,
        request_ids: Sequence[str | None] | None,
        priority: int | Sequence[int],
    ) -> Batch:
        """A batch call: ``make(prompt, params, request id, priority)`` makes each request
        (``kind``: its parameters' type), ``result`` is what the call returns of each; the
        arguments checked (one of each per prompt)."""
        params = _per_prompt(params, kind, len(prompts))
        ids = request_ids or [None] * len(prompts)
        if not len(params) == len(ids) == len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts, {len(params)} parameter sets and {len(ids)} "
                "request ids: give one of each per prompt"
            )
        priorities = _priorities(priority, len(prompts))
        return Batch(make, list(zip(prompts, params, ids, priorities, strict=True)), result)

    # -- lifetime ------------------------------------------------------------------------

    def mark_supervised(self) -> None:
        """For the launcher that made this client (``Engine.client()``), in this process: it
        calls ``engine_died`` when a stage dies, so a connection the engine closes waits a
        moment for its word on why before failing requests with a generic reason."""
        self._conn.mark_supervised()

    def scheduler_lost(self, reason: str, replica: int | None = None) -> None:
        """For the launcher that made this client: its engine's scheduler died (``reason``)
        and the engine restarts; the requests in flight fail, saying why. ``replica``: the
        data-parallel replica whose scheduler it was."""
        self._conn.scheduler_lost(reason, replica)

    def replica_moved(self, replica: int, address: str) -> None:
        """For the launcher that made this client: data-parallel ``replica`` serves at
        ``address`` now (started again elsewhere); the client connects there."""
        if isinstance(self._conn, Replicas):
            self._conn.readdress(replica, address)

    def replica_recovering(self, stage: str | None, replica: int | None = None) -> None:
        """For the launcher that made this client: the engine (or data-parallel replica)
        restarts its ``stage`` (None: done); new requests go to other replicas meanwhile."""
        self._conn.replica_recovering(stage, replica)

    def engine_died(self, reason: str, replica: int | None = None) -> None:
        """The engine died (its launcher says why): every pending request fails now with
        ``EngineDeadError(reason)``, and no new one can be sent. ``replica``: one replica
        died, whose requests fail; the others serve, and it is tried again later."""
        self._conn.engine_died(reason, replica)

    def abort(self, request_id: str) -> None:
        """Stop a request; its output finishes with reason ``abort``."""
        self._conn.abort_live([request_id])

    def close(self) -> None:
        """Abort this client's pending requests (their callers get ``ClientClosedError``)
        and close its sockets. Idempotent; also done when the client is garbage-collected."""
        self._conn.close()

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
