"""The IPC client library: connect to a running engine, sync or asyncio.

    with mpengine.launch(model="tiny") as engine:
        client = engine.client()
        out = client.generate("Hello", SamplingParams(max_tokens=16, temperature=0))
        print(out.text)

    client = mpengine.Client("ipc:///run/mpengine/requests.sock")   # a running engine

A client holds two DEALER sockets under one client id: requests go to the scheduler, outputs
come back from the output processor. One I/O thread owns both sockets (ZMQ sockets are not
thread-safe); callers hand it frames through an inproc pipe and receive deltas through
per-request queues. A disconnect of either engine socket means the engine died: every
pending request fails with ``EngineDeadError`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from mpengine.launch import EngineDeadError
from mpengine.protocol import (
    Abort,
    AddRequest,
    Array,
    EngineInfo,
    EngineStats,
    Hello,
    OutputBatch,
    OutputDelta,
    RequestError,
    SamplingParams,
    StatsQuery,
    encoder,
    output_reply_decoder,
    scheduler_reply_decoder,
)

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class InvalidRequestError(ValueError):
    """The engine rejected a request (bad prompt or parameters); it keeps serving."""


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    error: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0

    @property
    def time_to_first_token(self) -> float:
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """A request's result (or, from ``stream``, what changed since the last one).

    ``.text``, ``.token_ids``, ``.finish_reason`` and ``.logprobs`` are those of the first
    sample; ``.outputs`` has one ``CompletionOutput`` per sample when ``n > 1``.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


def _logprob_dicts(lp) -> list[dict[int, float]]:
    ids, values = lp.token_ids.numpy().tolist(), lp.logprobs.numpy().tolist()
    top_ids, top_values = lp.top_ids.numpy().tolist(), lp.top_logprobs.numpy().tolist()
    rows = []
    for tok, value, tops, top_vals in zip(ids, values, top_ids, top_values, strict=True):
        row = dict(zip(tops, top_vals, strict=True))
        row[tok] = value
        rows.append(row)
    return rows


class _Assembly:
    """Accumulates a request's deltas into a RequestOutput."""

    def __init__(self, request: AddRequest) -> None:
        assert request.sampling is not None
        n = request.sampling.n
        prompt_ids = request.prompt_token_ids.numpy().tolist()
        samples = [CompletionOutput(i) for i in range(n)]
        self.output = RequestOutput(request.request_id, prompt_ids, samples)
        self.num_open = n

    def add(self, delta: OutputDelta) -> RequestOutput:
        """Apply a delta; return it as a RequestOutput holding only what is new."""
        out = self.output.outputs[delta.index]
        new = CompletionOutput(delta.index, delta.text, delta.token_ids.numpy().tolist())
        out.text += delta.text
        out.token_ids += new.token_ids
        if delta.logprobs is not None:
            new.logprobs = _logprob_dicts(delta.logprobs)
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs += new.logprobs
        if delta.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None, *_logprob_dicts(delta.prompt_logprobs)]
        if delta.finish_reason is not None:
            out.finish_reason = new.finish_reason = delta.finish_reason
            out.stop_reason = new.stop_reason = delta.stop_reason
            out.error = new.error = delta.error
            self.num_open -= 1
            m = self.output.metrics
            m.arrival_time, m.scheduled_time = delta.arrival_time, delta.scheduled_time
            m.first_token_time = m.first_token_time or delta.first_token_time
            m.finished_time = max(m.finished_time, delta.finished_time)
        self.output.finished = self.num_open == 0
        return RequestOutput(
            self.output.request_id,
            self.output.prompt_token_ids,
            [new],
            self.output.finished,
            self.output.prompt_logprobs if delta.prompt_logprobs is not None else None,
            self.output.metrics,
        )


Sink = Callable[[object], None]  # receives OutputDelta, or an exception to raise


class _Connection:
    """Sockets, handshake and the I/O thread shared by Client and AsyncClient."""

    def __init__(self, address: str, timeout: float, client_id: str | None) -> None:
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.ctx = zmq.Context(io_threads=1)
        self.sinks: dict[str, Sink] = {}
        self.queries: dict[int, queue.SimpleQueue] = {}
        self.query_ids = itertools.count()
        self.dead: str | None = None
        self.lock = threading.Lock()
        self.closed = False
        try:
            self.requests = self._dealer(address)
            self.info = self._handshake(self.requests, scheduler_reply_decoder(), timeout)
            assert isinstance(self.info, EngineInfo)
            self.outputs = self._dealer(self.info.output_address)
            self._handshake(self.outputs, output_reply_decoder(), timeout)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.monitors = [
            s.get_monitor_socket(zmq.EVENT_DISCONNECTED) for s in (self.requests, self.outputs)
        ]
        pipe = f"inproc://tx-{self.client_id}"
        self.rx = self.ctx.socket(zmq.PAIR)
        self.rx.bind(pipe)
        self.tx = self.ctx.socket(zmq.PAIR)
        self.tx.connect(pipe)
        self.thread = threading.Thread(target=self._run, name="mpengine-client-io", daemon=True)
        self.thread.start()

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.client_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        return sock

    def _handshake(self, sock: zmq.Socket, decoder, timeout: float):
        sock.send(encoder.encode(Hello(self.client_id)))
        if not sock.poll(int(timeout * 1000)):
            raise ConnectionError(f"no engine answered at {sock.LAST_ENDPOINT!r} in {timeout} s")
        return decoder.decode(sock.recv())

    # -- the I/O thread -------------------------------------------------------------------

    def _run(self) -> None:
        replies, outputs = scheduler_reply_decoder(), output_reply_decoder()
        poller = zmq.Poller()
        for sock in (self.requests, self.outputs, self.rx, *self.monitors):
            poller.register(sock, zmq.POLLIN)
        while not self.closed:
            events = dict(poller.poll(100))
            if self.rx in events:
                while True:
                    try:
                        frame = self.rx.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if not frame.bytes:
                        return  # close()
                    self.requests.send(frame, copy=False)
            if self.outputs in events:
                while True:
                    try:
                        msg = outputs.decode(self.outputs.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if isinstance(msg, OutputBatch):
                        for delta in msg.deltas:
                            self._deliver(delta.request_id, delta)
            if self.requests in events:
                while True:
                    try:
                        msg = replies.decode(self.requests.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if isinstance(msg, RequestError):
                        self._deliver(msg.request_id, InvalidRequestError(msg.message), final=True)
                    elif isinstance(msg, EngineStats) and msg.query_id in self.queries:
                        self.queries.pop(msg.query_id).put(msg)
            if any(m in events for m in self.monitors):
                self.fail_all("the engine closed its connection (it stopped or died)")
                return

    def _deliver(self, request_id: str, item: object, final: bool = False) -> None:
        sink = self.sinks.get(request_id)
        if sink is None:
            return
        if final:
            self.sinks.pop(request_id, None)
        sink(item)

    def fail_all(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            sink(EngineDeadError(reason))
        for q in self.queries.values():
            q.put(EngineDeadError(reason))

    # -- caller side ----------------------------------------------------------------------

    def send(self, msg: msgspec.Struct) -> None:
        frame = encoder.encode(msg)
        if len(frame) > self.info.max_request_bytes:
            raise InvalidRequestError(
                f"request of {len(frame)} bytes exceeds the engine's max_request_bytes "
                f"({self.info.max_request_bytes})"
            )
        with self.lock:
            if self.dead:
                raise EngineDeadError(self.dead)
            self.tx.send(frame)

    def submit(self, request: AddRequest, sink: Sink) -> None:
        if request.request_id in self.sinks:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.sinks[request.request_id] = sink
        try:
            self.send(request)
        except BaseException:
            self.sinks.pop(request.request_id, None)
            raise

    def forget(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)

    def stats(self, timeout: float) -> EngineStats:
        query_id = next(self.query_ids)
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self.queries[query_id] = reply
        self.send(StatsQuery(query_id))
        try:
            result = reply.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no stats from the engine in {timeout} s") from None
        finally:
            self.queries.pop(query_id, None)
        if isinstance(result, Exception):
            raise result
        return result

    def close(self) -> None:
        if self.closed:
            return
        pending = list(self.sinks)
        if pending and not self.dead:
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                self.send(Abort(pending))
        with self.lock:
            self.tx.send(b"")
        self.thread.join(5.0)
        self.closed = True
        for sock in (*self.monitors, self.rx, self.tx, self.requests, self.outputs):
            sock.close(linger=0)
        self.ctx.term()


class _ClientBase:
    def __init__(self, address: str, timeout: float, client_id: str | None) -> None:
        self._conn = _Connection(address, timeout, client_id)
        self._tokenizer = None
        self._ids = itertools.count()

    @property
    def info(self) -> EngineInfo:
        return self._conn.info

    @property
    def client_id(self) -> str:
        return self._conn.client_id

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (loaded in this process)."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(Path(self.info.tokenizer) / "tokenizer.json"))
        return self._tokenizer.encode(text).ids

    def _request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None
    ) -> AddRequest:
        params = (params or SamplingParams()).validate()
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id or f"{self.client_id}-{next(self._ids)}"
        return AddRequest(request_id, Array.of(ids), params, arrival_time=time.time())

    def _engine_died(self, reason: str) -> None:
        self._conn.fail_all(reason)

    def abort(self, request_id: str) -> None:
        """Stop a request; its output finishes with reason ``abort``."""
        self._conn.send(Abort([request_id]))

    def close(self) -> None:
        """Abort this client's pending requests and close its sockets."""
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handle:
    """One submitted request seen from a blocking caller."""

    def __init__(self, conn: _Connection, request: AddRequest) -> None:
        self.conn = conn
        self.request_id = request.request_id
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.assembly = _Assembly(request)
        conn.submit(request, self.items.put)

    @property
    def finished(self) -> bool:
        return self.assembly.output.finished

    def next_delta(self, deadline: float | None) -> RequestOutput:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            item = self.items.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no output in time") from None
        if isinstance(item, Exception):
            raise item
        delta = self.assembly.add(item)
        if delta.finished:
            self.conn.forget(self.request_id)
        return delta

    def result(self, deadline: float | None) -> RequestOutput:
        while not self.finished:
            self.next_delta(deadline)
        return self.assembly.output

    def cancel(self) -> None:
        """Abort if still running (the caller stopped listening)."""
        if not self.finished and not self.conn.dead and not self.conn.closed:
            self.conn.forget(self.request_id)
            self.conn.send(Abort([self.request_id]))


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class Client(_ClientBase):
    """Blocking client. Thread-safe: many threads may generate at once."""

    def __init__(self, address: str, *, timeout: float = 30.0, client_id: str | None = None):
        super().__init__(address, timeout, client_id)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each delta as the engine produces it (the last has ``finished``).
        Leaving the loop early aborts the request."""
        handle = _Handle(self._conn, self._request(prompt, params, request_id))
        deadline = _deadline(timeout)
        try:
            while not handle.finished:
                yield handle.next_delta(deadline)
        finally:
            handle.cancel()

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        """Run one request to completion."""
        return self.generate_many([prompt], params, timeout=timeout, request_ids=[request_id])[0]

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
        request_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Submit every prompt at once (so they batch); return the outputs in order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = request_ids or [None] * len(prompts)
        deadline = _deadline(timeout)
        handles: list[_Handle] = []
        try:
            for prompt, p, rid in zip(prompts, params, ids, strict=True):
                handles.append(_Handle(self._conn, self._request(prompt, p, rid)))
            return [h.result(deadline) for h in handles]
        finally:
            for handle in handles:
                handle.cancel()

    def stats(self, timeout: float = 10.0) -> EngineStats:
        """The scheduler's counters: queues, free blocks, preemptions..."""
        return self._conn.stats(timeout)


class AsyncClient(_ClientBase):
    """asyncio client over the same connection machinery (the I/O thread hands deltas to
    the event loop)."""

    def __init__(self, address: str, *, timeout: float = 30.0, client_id: str | None = None):
        super().__init__(address, timeout, client_id)

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield each delta as the engine produces it; leaving early aborts the request."""
        request = self._request(prompt, params, request_id)
        async for delta in self._run(request, _Assembly(request)):
            yield delta

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestOutput:
        """Run one request to completion."""
        request = self._request(prompt, params, request_id)
        assembly = _Assembly(request)
        async for _ in self._run(request, assembly):
            pass
        return assembly.output

    async def _run(self, request: AddRequest, assembly: _Assembly) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self._conn.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            while not assembly.output.finished:
                item = await items.get()
                if isinstance(item, Exception):
                    raise item
                yield assembly.add(item)
        finally:
            self._conn.forget(request.request_id)
            if not assembly.output.finished and not self._conn.dead and not self._conn.closed:
                self._conn.send(Abort([request.request_id]))

    async def stats(self, timeout: float = 10.0) -> EngineStats:
        return await asyncio.to_thread(self._conn.stats, timeout)
