"""The engine requests of one HTTP request: one per prompt, submitted through the IPC
client library, merged into one stream, counted in the metrics, aborted with their client.

An HTTP client that goes away aborts its requests, so their KV blocks are freed at once:
a streaming response is cancelled by Starlette when the client disconnects, and
``until_disconnected`` does the same for a response still being computed. Cancelling a
``Generation`` cancels the tasks that read the engine streams, whose ``finally`` aborts the
engine requests (``AsyncClient.stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request

from mpengine.client.outputs import RequestOutput
from mpengine.errors import InvalidRequestError
from mpengine.protocol import SamplingParams
from mpengine.server.errors import APIError, from_engine
from mpengine.server.request_logs import log_request

if TYPE_CHECKING:
    from mpengine.server.state import ServerState

T = TypeVar("T")

RANK_HEADER = "X-data-parallel-rank"  # vLLM's: the replica that runs the request


def pinned_rank(state: ServerState, request: Request) -> int | None:
    """The data-parallel replica the request's ``X-data-parallel-rank`` header pins (None:
    the client's router chooses); a bad one is a 400."""
    value = request.headers.get(RANK_HEADER)
    if value is None:
        return None
    size = state.client.data_parallel_size
    if not value.strip().isdigit() or not 0 <= int(value) < size:
        raise APIError(
            400,
            f"{RANK_HEADER} {value!r}: this server's engine has {size} replicas (0..{size - 1})",
        )
    return int(value)


@dataclass(slots=True)
class Sample:
    """One sample of one prompt, assembled from its deltas (non-streaming responses)."""

    texts: list[str] = field(default_factory=list)  # joined once read (one delta a token)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, delta: RequestOutput) -> None:
        out = delta.outputs[0]
        self.texts.append(out.text)
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.logprobs  # (in place: a new list each delta was quadratic)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclass(slots=True)
class PromptResult:
    prompt_token_ids: list[int]
    samples: list[Sample]
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    num_generated: int = 0  # by every sample, returned or not (best_of > n): the usage


class Generation:
    """The engine requests of one HTTP request (one per prompt), as one stream of
    ``(prompt index, delta)`` in arrival order. Counts as in flight (what a drain waits for)
    from creation until ``close``.

    One prompt (the usual case) is read straight from its stream; several are read by one
    task each into a queue, so that a slow prompt does not hold up the others. With
    ``best_of > n`` the engine sends the best ``n`` samples only once all have ended: each
    prompt's "stream" is then its whole result, one sample at a time.
    """

    def __init__(
        self,
        state: ServerState,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        user: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.state = state
        self.prompts = prompts
        self.params = params
        if state.log_requests:
            log_request(request_id, prompts, params, state.text.decode)
        ranked = not params.streams
        self.trackers = [state.metrics.tracker(len(p), params.n, ranked) for p in prompts]
        self.refused = False
        read = state.client.stream if params.streams else self._ranked
        # Whose share of the engine it uses: its ``user``'s, else its own (all its prompts
        # and samples together: one HTTP request cannot take the whole engine).
        tenant = user or request_id
        self.streams = [
            read(
                prompt,
                params,
                request_id=f"{request_id}-{index}",
                priority=priority,
                tenant=tenant,
                data_parallel_rank=rank,
            )
            for index, prompt in enumerate(prompts)
        ]
        self.num_open = len(prompts)
        self.closed = False
        state.num_inflight += 1
        self.items: asyncio.Queue[tuple[int, RequestOutput | APIError | None]] = asyncio.Queue()
        self.tasks = []
        if len(prompts) > 1:
            self.tasks = [asyncio.create_task(self._pump(i)) for i in range(len(prompts))]

    async def _ranked(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        tenant: str,
        data_parallel_rank: int | None,
    ) -> AsyncIterator[RequestOutput]:
        """A ranked request's result as one delta per returned sample, the last one
        ``finished``; the first carries the tokens all ``best_of`` samples generated."""
        client = self.state.client
        out = await client.generate(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            tenant=tenant,
            data_parallel_rank=data_parallel_rank,
        )
        for sample in out.outputs:
            total = out.num_generated_tokens if sample.index == 0 else 0
            yield RequestOutput(
                out.request_id,
                out.prompt_token_ids,
                [sample],
                sample is out.outputs[-1],
                out.prompt_logprobs,
                out.metrics,
                total,
                out.prompt_logprob_ranks,
            )

    async def _read(self, index: int) -> RequestOutput | None:
        """Prompt ``index``'s next delta (None after its last), counted in the metrics; an
        engine error raises ``APIError``."""
        try:
            delta = await anext(self.streams[index])
        except StopAsyncIteration:
            return None
        except Exception as exc:
            if isinstance(exc, InvalidRequestError):  # refused: it never ran
                self.trackers[index].on_refused()
                self.refused = True
            raise from_engine(exc) from None
        self.trackers[index].on_output(delta)
        return delta

    async def _pump(self, index: int) -> None:
        try:
            while (delta := await self._read(index)) is not None:
                self.items.put_nowait((index, delta))
            self.items.put_nowait((index, None))
        except APIError as exc:
            self.items.put_nowait((index, exc))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next delta of any prompt, or None once all are finished. An engine error
        (overloaded, invalid...) raises ``APIError``; ``close`` then aborts the others."""
        if not self.tasks:
            delta = await self._read(0) if self.num_open else None
            if delta is None:
                self.num_open = 0
                return None
            return 0, delta
        while self.num_open:
            index, item = await self.items.get()
            if item is None:
                self.num_open -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                return index, item
        return None

    async def collect(self) -> list[PromptResult]:
        """Every prompt's samples, assembled (non-streaming responses)."""
        n = self.params.n
        results = [PromptResult(p, [Sample() for _ in range(n)]) for p in self.prompts]
        try:
            while (item := await self.next()) is not None:
                index, delta = item
                result = results[index]
                result.samples[delta.outputs[0].index].add(delta)
                if not self.params.streams:
                    result.num_generated += delta.num_generated_tokens
                else:
                    result.num_generated += len(delta.outputs[0].token_ids)
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                    result.prompt_logprob_ranks = delta.prompt_logprob_ranks
        finally:
            await self.close()
        return results

    async def close(self) -> None:
        """Abort what is still running (idempotent); its open samples count as aborted.
        Everything that matters happens before the first await: a response cancelled by
        its client's disconnect runs this in a cancelled scope, where every await raises."""
        if self.closed:
            return
        self.closed = True
        self.state.num_inflight -= 1
        for tracker in self.trackers:
            # Refused as a whole (one prompt was): its prompts that never answered were
            # most likely refused too (their errors unread), so none counts as aborted.
            if self.refused and not tracker.answered:
                tracker.on_refused()
            else:
                tracker.on_abandoned()
        for task in self.tasks:
            task.cancel()  # thrown into the stream it reads, whose ``finally`` aborts
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        else:
            # Runs the stream's ``finally`` (which aborts the engine request if it still
            # runs) at once, with no suspension that a cancellation could interrupt.
            await self.streams[0].aclose()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the HTTP client disconnects first (the body has been
    read, so the next ASGI message can only be the disconnect)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise APIError(499, "the client closed the request")
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
