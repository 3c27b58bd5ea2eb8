"""``POST /v1/embeddings``: OpenAI's embeddings, with vLLM's ``truncate_prompt_tokens``,
``normalize`` and ``pooling``.

``input`` is a string, a list of strings, token ids or a list of token-id lists; each is one
engine request, all submitted at once so that they batch, and ``data[i]`` is input ``i``'s
embedding: a list of floats, or with ``encoding_format: "base64"`` the base64 of its
little-endian float32 bytes (what the ``openai`` package asks for by default). Text is
tokenized by the client library, which truncates it as ``truncate_prompt_tokens`` says
(with vLLM's ``add_special_tokens: false``, here, without the tokenizer's special tokens).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import TYPE_CHECKING

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from mpengine.protocol import PoolingParams
from mpengine.server.errors import bad_request, field_of, from_engine
from mpengine.server.generation import pinned_rank, until_disconnected
from mpengine.server.request_logs import log_request
from mpengine.server.schemas import EmbeddingData, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from mpengine.server.state import ServerState

if TYPE_CHECKING:
    from mpengine.client.outputs import EmbeddingOutput

Prompt = str | list[int]

# The request's fields that map onto ``PoolingParams``, and the engine's names for the
# prompt, which this endpoint calls ``input``.
_POOLING_FIELDS = ("pooling", "normalize", "dimensions", "truncate_prompt_tokens")
_PROMPT_FIELDS = ("prompt", "prompt_token_ids")


async def create_embedding(
    state: ServerState, body: EmbeddingRequest, request: Request
) -> Response:
    model = state.check_model(body.model)
    state.check_admitting()
    if state.info.pooling is None:
        message = (
            f"the model {model!r} cannot embed: it is a generation model "
            "(use /v1/completions or /v1/chat/completions)"
        )
        raise bad_request(message, "model")
    prompts = _prompts(state, body.input)
    try:
        params = body.pooling_params()
    except (msgspec.ValidationError, ValueError) as exc:
        raise bad_request(str(exc), _param_of(str(exc))) from None
    if not body.add_special_tokens:  # tokenized here (the client library adds them)
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        encoded = iter(await state.text.encode(texts, add_special_tokens=False, field="input"))
        prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
    request_id = f"embd-{uuid.uuid4().hex}"
    rank = pinned_rank(state, request)
    work = _embed(state, prompts, params, request_id, body.priority, body.user, rank)
    outputs = await until_disconnected(request, work)
    data = [
        EmbeddingData(index, encode(out.embedding, body.encoding_format))
        for index, out in enumerate(outputs)
    ]
    num_prompt = sum(out.num_prompt_tokens for out in outputs)
    reply = EmbeddingList(
        request_id, int(time.time()), model, data, EmbeddingUsage(num_prompt, num_prompt)
    )
    return Response(msgspec.json.encode(reply), media_type="application/json")


def _prompts(
    state: ServerState, value: str | list[str] | list[int] | list[list[int]]
) -> list[Prompt]:
    """Each input, as text or token ids; an empty one is a bad request."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        items: list[Prompt] = [value]  # one input: a string or token ids
    else:
        items = list(value)
    if not items or any(not (item.strip() if isinstance(item, str) else item) for item in items):
        message = "input is empty (or holds an empty or blank string, or an empty token list)"
        raise bad_request(message, "input")
    if state.text.tokenizer is None and any(isinstance(item, str) for item in items):
        raise bad_request("the model has no tokenizer.json: send token ids", "input")
    return items


def _param_of(message: str) -> str | None:
    """The request field an error message names."""
    if (field := field_of(message)) is not None:
        return "input" if field in _PROMPT_FIELDS else field
    if message.startswith("the input"):
        return "input"
    return next((name for name in _POOLING_FIELDS if message.startswith(name)), None)


async def _embed(
    state: ServerState,
    prompts: list[Prompt],
    params: PoolingParams,
    request_id: str,
    priority: int = 0,
    user: str | None = None,
    rank: int | None = None,
) -> list[EmbeddingOutput]:
    """Every input's embedding; counted in flight (what a drain waits for) and in the
    request metrics, each input as it finishes. A cancelled call (the HTTP client went
    away) aborts the requests: the inputs not finished then count as aborted."""
    request_ids = [f"{request_id}-{index}" for index in range(len(prompts))]
    if state.log_requests:
        log_request(request_id, prompts, params, state.text.decode)  # type: ignore[arg-type]
    finished = 0

    def count(_: int, out: EmbeddingOutput) -> None:
        nonlocal finished
        finished += 1
        _count(state, out)

    state.num_inflight += 1
    try:
        return await state.client.embed_many(
            prompts,
            params,
            request_ids=request_ids,
            priority=priority,
            tenant=user or request_id,  # whose share it uses (see ``Generation``)
            on_output=count,
            data_parallel_rank=rank,
        )
    except asyncio.CancelledError:
        for _ in range(len(prompts) - finished):
            state.metrics.success("abort")
        raise
    except Exception as exc:
        error = from_engine(exc)
        if error.status == 400:
            error.param = _param_of(error.message)
        raise error from None
    finally:
        state.num_inflight -= 1


def _count(state: ServerState, out: EmbeddingOutput) -> None:
    """The request metrics that apply to an embedding: prompt tokens, latency, queue time,
    and one success (``stop``)."""
    t = out.metrics
    m = state.metrics.series(t.data_parallel_rank)
    m.prompt_tokens.inc(out.num_prompt_tokens)
    m.request_prompt_tokens.observe(out.num_prompt_tokens)
    if t.scheduled_time:
        m.queue.observe(max(0.0, t.scheduled_time - t.arrival_time))
    if t.finished_time:
        m.e2e.observe(max(0.0, t.finished_time - t.arrival_time))
    m.success("stop")


def encode(embedding: np.ndarray, encoding_format: str) -> list[float] | str:
    """An embedding as the response carries it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(embedding, dtype=np.float32).tolist()
