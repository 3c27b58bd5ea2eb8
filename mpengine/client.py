"""The IPC client library: connect to a running engine, sync or asyncio.

    with mpengine.launch(model="tiny") as engine:
        client = engine.client()
        out = client.generate("Hello", SamplingParams(max_tokens=16, temperature=0))
        print(out.text)

    with mpengine.launch(model="smollm2-135m") as engine:   # through the chat template
        reply = engine.client().chat([{"role": "user", "content": "Hi"}])

    with mpengine.launch(model="tiny-bert") as engine:      # an embedding model
        vectors = [o.embedding for o in engine.client().embed_many(["a", "b"])]

    client = mpengine.Client("tcp://gpu-box:5555", auth_token="...")   # a running engine

How it is built, bottom up:

- ``_Dealer``: one DEALER socket to one engine edge under the client id, with a monitor of
  its connection events; it says hello (``Hello`` -> ``EngineInfo`` from the scheduler,
  ``Hello`` -> ``Hello`` from the output processor) and turns a refused handshake into a
  clear error (``PermissionError`` for a wrong or missing auth token).
- ``_Connection``: both dealers and the one I/O thread that owns them (ZMQ sockets are not
  thread-safe). Callers never touch a socket: they queue frames in an outbox and wake the
  thread through a pipe; the thread hands deltas and replies to per-request *sinks*
  (callables). One failing delivery (a closed event loop, a frame that does not decode)
  fails only the requests involved. A disconnect of either engine socket means the engine
  died: every pending request fails with ``EngineDeadError``. When the thread stops (close,
  engine death, or the client object garbage-collected) it aborts what is pending, in
  frames of at most ``ABORT_CHUNK_BYTES``, and closes its own sockets.
- ``Client`` / ``AsyncClient``: the public API over one connection; they share everything
  but the waiting (``_SyncRequest`` blocks on a queue, ``_AsyncRequest`` awaits one; the
  requests of a batch call share one, ``_BatchRequest``, so that any refusal raises at once).

Every client of a process uses one ZMQ context that is never terminated, so no garbage
collection or interpreter exit can block on it; sockets are closed by the thread that owns
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import select
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from mpengine.addresses import WILDCARD_HOSTS, split_tcp
from mpengine.errors import (
    ClientClosedError,
    EngineDeadError,
    InvalidRequestError,
    ProtocolError,
    RequestFailedError,
)
from mpengine.protocol import (
    INT32_MAX,
    MAX_REQUEST_ID,
    Abort,
    AddRequest,
    Array,
    EngineInfo,
    EngineStats,
    Hello,
    Logprobs,
    OutputBatch,
    OutputDelta,
    PoolingParams,
    RequestError,
    SamplingParams,
    StatsQuery,
    TokenizerFile,
    TokenizerQuery,
    encoder,
    lone_surrogate,
    output_reply_decoder,
    scheduler_reply_decoder,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from mpengine.chat_template import ChatTemplate

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
# A conversation: OpenAI's messages, ``{"role": "user", "content": "Hi"}``...
Conversation = Sequence[Mapping[str, Any]]
Sink = Callable[[Any], None]  # receives a delta or reply, or an exception to raise
T = TypeVar("T")

POLL_MS = 100  # the I/O thread's longest sleep: how soon it sees a dropped client
ABORT_CHUNK_BYTES = 32 * 1024  # largest Abort frame (also at most max_request_bytes / 2)
ABORT_LINGER_MS = 2000  # how long closed sockets keep trying to deliver the last aborts
MAX_FRAMES_PER_TURN = 1000  # frames read from one socket before serving the others
TCP_HEARTBEAT_MS = 2000  # ZMTP pings: a vanished remote engine counts as a disconnect...
TCP_HEARTBEAT_TIMEOUT_MS = 20000  # ...after this long without an answer
_MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# A client made by a launcher in this process, seeing the engine close its connection,
# waits this long for the launcher's word on why (a stage's error) before a generic one.
LAUNCHER_WORD_S = 1.0
HELLO_RETRY_S = 0.1  # the first wait for a hello's answer before connecting again
MAX_CLIENT_ID_BYTES = 200  # a caller's client name (ZMQ routing ids: 255 bytes at most)
HELLO_SEND_POLL_S = 0.01  # how often a hello no connection takes yet is tried again
HELLO_RETRY_MAX_S = 2.0


def token_array(prompt: Sequence[int]) -> Array:
    """A prompt's token ids as the int32 array a request carries; anything else (bytes, a
    float, an id beyond int32) is the caller's mistake, named as such."""
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise InvalidRequestError("prompt: expected text or a list of token ids, not bytes")
    ids = prompt if isinstance(prompt, np.ndarray) else np.asarray(list(prompt))
    if ids.size:
        integral = ids.dtype.kind in "iu" or (
            ids.dtype.kind == "O" and all(type(t) is int for t in ids.flat)  # beyond int64
        )
        if ids.ndim != 1 or not integral:
            raise InvalidRequestError("prompt: token ids must be a flat list of integers")
        if ids.min() < -INT32_MAX - 1 or ids.max() > INT32_MAX:
            raise InvalidRequestError("prompt: a token id is outside int32")
    return Array.of(ids)


# -- outputs ---------------------------------------------------------------------------------


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
    # The sum of the sample's token logprobs, when logprobs were asked for or samples are
    # ranked (best_of > n); for beam search the beam's score (that sum divided by
    # length ** length_penalty). In a stream, the sum so far.
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first token and finished
    (``time.time()`` seconds; 0 until known). A stream's deltas share the request's one
    object, complete once the request has finished."""

    arrival_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0

    @property
    def time_to_first_token(self) -> float:
        """Seconds from arrival to the first token (once there is one)."""
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
    # Tokens generated by all samples: more than the outputs hold when best_of > n (the
    # request's total: on a stream's final delta).
    num_generated_tokens: int = 0
    # Each prompt token's rank among the vocabulary at its position (1 = most likely; the
    # first is None), beside ``prompt_logprobs``.
    prompt_logprob_ranks: list[int | None] | None = None

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


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding (float32, ``dimensions`` long when asked for)."""

    request_id: str
    embedding: np.ndarray
    prompt_token_ids: list[int]
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _logprob_dicts(lp: Logprobs) -> list[dict[int, float]]:
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
        n = request.sampling.n if request.sampling is not None else 1
        prompt_ids = request.prompt_token_ids.numpy().tolist()
        samples = [CompletionOutput(i) for i in range(n)]
        self.output = RequestOutput(request.request_id, prompt_ids, samples)
        # Each sample's text, joined once it has finished (adding each delta's to a string
        # copied the whole text each time: 0.2 s at 32k tokens).
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.num_open = n
        self.embedding: np.ndarray | None = None  # a pooling request's result
        self.num_prompt_tokens = 0  # as the engine counted them (on the final delta)

    def add(self, delta: OutputDelta) -> RequestOutput:
        """Apply a delta; return it as a RequestOutput holding only what is new."""
        out = self.output.outputs[delta.index]
        new = CompletionOutput(delta.index, delta.text, delta.token_ids.numpy().tolist())
        self.texts[delta.index].append(delta.text)
        out.token_ids += new.token_ids
        if delta.embedding is not None:
            self.embedding = delta.embedding.numpy().copy()
            self.num_prompt_tokens = delta.num_prompt_tokens
        if delta.logprobs is not None:
            new.logprobs = _logprob_dicts(delta.logprobs)
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs += new.logprobs
        if delta.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None, *_logprob_dicts(delta.prompt_logprobs)]
            ranks = delta.prompt_logprobs.ranks
            if ranks.shape and ranks.shape[0] == len(delta.prompt_logprobs.token_ids):
                self.output.prompt_logprob_ranks = [None, *ranks.numpy().tolist()]
        ranked = delta.cumulative_logprob is not None  # index 0 counts every sample's tokens
        if ranked:
            out.cumulative_logprob = delta.cumulative_logprob
        elif delta.logprobs is not None:  # as vLLM: the sum of the sampled tokens' logprobs
            total = out.cumulative_logprob or 0.0
            for value in delta.logprobs.logprobs.numpy().tolist():
                total += value
            out.cumulative_logprob = total
        new.cumulative_logprob = out.cumulative_logprob
        self.output.num_generated_tokens += (
            delta.num_generated_tokens if ranked else len(new.token_ids)
        )
        if delta.finish_reason is not None:
            out.text = "".join(self.texts[delta.index])
            out.finish_reason = new.finish_reason = delta.finish_reason
            out.stop_reason = new.stop_reason = delta.stop_reason
            out.error = new.error = delta.error
            self.num_open -= 1
            m = self.output.metrics
            m.arrival_time, m.scheduled_time = delta.arrival_time, delta.scheduled_time
            m.first_token_time = m.first_token_time or delta.first_token_time
            m.finished_time = max(m.finished_time, delta.finished_time)
        self.output.finished = self.num_open == 0
        fresh = delta.prompt_logprobs is not None
        return RequestOutput(
            self.output.request_id,
            self.output.prompt_token_ids,
            [new],
            self.output.finished,
            self.output.prompt_logprobs if fresh else None,
            self.output.metrics,
            prompt_logprob_ranks=self.output.prompt_logprob_ranks if fresh else None,
        )

    def embedding_output(self) -> EmbeddingOutput:
        """The finished pooling request's result, or ``RequestFailedError``."""
        out = self.output
        if self.embedding is None:
            first = out.outputs[0]
            raise RequestFailedError(
                f"request {out.request_id!r} ended ({first.finish_reason}) without its "
                f"embedding: {first.error or 'no reason given'}"
            )
        # The engine truncates token ids when asked to (truncate_prompt_tokens).
        prompt = out.prompt_token_ids[: self.num_prompt_tokens or None]
        return EmbeddingOutput(out.request_id, self.embedding, prompt, out.metrics)


# asyncio front ends (``AsyncClient``, the HTTP server) tokenize texts longer than this, in
# all, in a worker thread: a multi-megabyte prompt takes seconds, which must not stall every
# other request on the event loop. ``tokenizers`` releases the GIL in ``encode_batch`` (it
# holds it in ``encode``), so the loop keeps running meanwhile.
INLINE_TOKENIZE_CHARS = 8192


def encode_texts(
    tokenizer: Tokenizer, texts: Sequence[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each text, with the GIL released (``encode_batch``). A text that is not
    Unicode (a lone UTF-16 surrogate, which JSON can escape) raises ``ValueError``."""
    try:
        encodings = tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    except TypeError:
        if any(isinstance(text, str) and lone_surrogate(text) for text in texts):
            raise ValueError("the prompt holds a lone UTF-16 surrogate: not Unicode text") from None
        raise
    return [encoding.ids for encoding in encodings]


async def off_the_loop(texts: Iterable[object], work: Callable[[], T]) -> T:
    """``work()``, in a worker thread when ``texts`` (prompts: strings or token ids) hold
    more than :data:`INLINE_TOKENIZE_CHARS` characters of text."""
    size = sum(len(t) for t in texts if isinstance(t, str))
    return work() if size <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(work)


def as_transformers_encodes(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` encoding one text as ``transformers``' ``tokenizer(text)`` does: a
    ``tokenizer.json`` may carry padding and truncation settings (all-MiniLM-L6-v2's pads
    and cuts every input to 128 tokens), which ``tokenizers`` applies and ``transformers``
    does not unless asked."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


# -- building blocks: context, addresses, deadlines, abort frames ---------------------------

_shared_context: zmq.Context | None = None
_shared_context_pid = 0
_shared_context_lock = threading.Lock()


def _context() -> zmq.Context:
    """The process-wide ZMQ context of every client: created on first use (again in a
    forked child), never terminated, so nothing ever waits in ``Context.term()``."""
    global _shared_context, _shared_context_pid
    with _shared_context_lock:
        if _shared_context is None or _shared_context_pid != os.getpid():
            _shared_context = zmq.Context(io_threads=1)
            _shared_context_pid = os.getpid()
        return _shared_context


def connectable(address: str) -> str:
    """An address a client can connect to: a wildcard tcp host (an engine's bind address,
    ``tcp://*:5555``) means this host; ``ipc://DIR``, the directory an engine was given as
    its address, means its request socket ``ipc://DIR/requests.sock``."""
    if not address.startswith(("ipc://", "tcp://")):
        raise ValueError(
            f"{address!r} is not an engine address: ipc://PATH (a socket or the engine's "
            "directory) or tcp://HOST:PORT"
        )
    if address.startswith("ipc://") and os.path.isdir(address[len("ipc://") :]):
        return address.rstrip("/") + "/requests.sock"
    parts = split_tcp(address)
    if parts is None or parts[0] not in WILDCARD_HOSTS:
        return address
    loopback = "[::1]" if parts[0].startswith("[") or parts[0] == "::" else "127.0.0.1"
    return f"tcp://{loopback}:{parts[1]}"


def output_address(request_address: str, advertised: str) -> str:
    """Where to connect for outputs: the engine's advertised output address, except that a
    wildcard host (the engine binds every interface, ``tcp://*:5556``) becomes the host this
    client reached the engine at for requests."""
    out = split_tcp(advertised)
    if out is None or out[0] not in WILDCARD_HOSTS:
        return advertised
    request = split_tcp(request_address)
    return connectable(advertised) if request is None else f"tcp://{request[0]}:{out[1]}"


def abort_frames(request_ids: Iterable[str], max_bytes: int = ABORT_CHUNK_BYTES) -> list[bytes]:
    """``Abort`` frames for ``request_ids``, each at most ``max_bytes`` (or one id)."""
    frames: list[bytes] = []
    chunk: list[str] = []
    size = 16  # tag and array headers
    for request_id in request_ids:
        cost = len(request_id.encode()) + 5  # msgpack str header
        if chunk and size + cost > max_bytes:
            frames.append(encoder.encode(Abort(chunk)))
            chunk, size = [], 16
        chunk.append(request_id)
        size += cost
    if chunk:
        frames.append(encoder.encode(Abort(chunk)))
    return frames


class _Deadline:
    """A point in time some call must finish by (none when ``timeout`` is None, or longer
    than a thread can wait: ``math.inf`` is no deadline either)."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        never = timeout is None or timeout >= threading.TIMEOUT_MAX
        self.at = None if never else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def error(self, what: str) -> TimeoutError:
        return TimeoutError(f"{what} within {self.timeout:g} s")


def _request_error(error: RequestError) -> Exception:
    if error.kind == "unauthorized":
        return PermissionError(error.message)
    return InvalidRequestError(error.message, error.kind)


def _ids_in_bad_frame(frame: bytes) -> tuple[list[str], list[int]]:
    """The request ids and query ids a frame that failed to decode was about, if its
    msgpack can be read at all (array-like structs: ``[tag, first field, ...]``)."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return [], []
    if not isinstance(obj, list) or len(obj) < 2:
        return [], []
    tag, first = obj[0], obj[1]
    if tag == "OutputBatch" and isinstance(first, list):
        ids = [d[1] for d in first if isinstance(d, list) and len(d) > 1 and isinstance(d[1], str)]
        return ids, []
    if tag == "RequestError" and isinstance(first, str) and first:
        return [first], []
    if tag in ("EngineStats", "TokenizerFile") and isinstance(first, int):
        return [], [first]
    return [], []


# -- one socket to one engine edge -----------------------------------------------------------


class _Dealer:
    """A DEALER socket to one engine edge under the client id, and a monitor of its
    connection events (handshake failures, disconnects)."""

    def __init__(
        self, ctx: zmq.Context, address: str, client_id: str, auth_token: str | None
    ) -> None:
        self.address = address
        self.secure = bool(auth_token)
        self.sock = ctx.socket(zmq.DEALER)
        self.monitor: zmq.Socket | None = None
        try:
            self.sock.setsockopt(zmq.ROUTING_ID, client_id.encode())
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, 0)
            self.sock.setsockopt(zmq.RCVHWM, 0)
            tcp = split_tcp(address)
            if tcp is not None:
                self.sock.setsockopt(zmq.HEARTBEAT_IVL, TCP_HEARTBEAT_MS)
                self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, TCP_HEARTBEAT_TIMEOUT_MS)
                if tcp[0].startswith("["):
                    self.sock.setsockopt(zmq.IPV6, 1)
            if auth_token:
                from mpengine.runtime.auth import secure_client

                secure_client(self.sock, auth_token)
            # Our own endpoint name (pyzmq's is derived from a reusable file descriptor),
            # connected before the socket is, so no handshake event is missed.
            endpoint = f"inproc://mpengine-monitor-{uuid.uuid4().hex}"
            self.sock.monitor(endpoint, _MONITOR_EVENTS)
            self.monitor = ctx.socket(zmq.PAIR)
            self.monitor.setsockopt(zmq.LINGER, 0)
            self.monitor.connect(endpoint)
            self.sock.connect(address)
        except BaseException:
            self.close()
            raise

    def handshake(self, hello: bytes, decoder: msgspec.msgpack.Decoder, deadline: _Deadline) -> Any:
        """Send ``hello`` and return the engine's answer; raise ``ConnectionError`` (or
        ``PermissionError`` when the engine refused the auth token) if there is none."""
        assert self.monitor is not None
        # Never a blocking send: a DEALER with no connection to the engine (one that hung up
        # on a failed handshake) blocks until it has one, past any deadline.
        sent = self._try_send(hello)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        # An engine ignores a connection under a routing id another one holds (two clients
        # given the same id: not this library's, which adds a nonce): without an answer,
        # connect again (and say hello again) after 0.1 s, then twice as long each time.
        retry_s, retry_at = HELLO_RETRY_S, time.monotonic() + HELLO_RETRY_S
        while True:
            remaining = deadline.remaining()
            if remaining is None:  # (no deadline: retry until an engine answers)
                remaining = HELLO_RETRY_MAX_S
            elif remaining <= 0:
                raise ConnectionError(
                    f"no answer from an engine at {self.address} within {deadline.timeout:g} s:"
                    " is it running there?"
                )
            if time.monotonic() >= retry_at:
                with contextlib.suppress(zmq.ZMQError):  # (not connected: ENOENT)
                    self.sock.disconnect(self.address)
                self.sock.connect(self.address)
                sent = self._try_send(hello)
                retry_s = min(2 * retry_s, HELLO_RETRY_MAX_S)
                retry_at = time.monotonic() + retry_s
            elif not sent:
                sent = self._try_send(hello)
            wait_s = min(remaining, max(0.0, retry_at - time.monotonic()))
            if not sent:
                wait_s = min(wait_s, HELLO_SEND_POLL_S)
            events = dict(poller.poll(max(1, int(wait_s * 1000))))
            if self.sock in events:
                frame = self.sock.recv()
                try:
                    reply = decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise ConnectionError(
                        f"the peer at {self.address} is not a compatible mpengine engine: "
                        f"its answer does not decode ({exc})"
                    ) from None
                if isinstance(reply, RequestError):
                    message = f"the engine at {self.address} refused the connection: "
                    if reply.kind == "unauthorized":
                        raise PermissionError(message + reply.message)
                    raise ConnectionError(message + reply.message)
                return reply
            if self.monitor in events:
                for event, value in self.events():
                    if failure := self._handshake_failure(event, value):
                        raise failure

    def _try_send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _handshake_failure(self, event: int, value: int) -> Exception | None:
        where = f"the engine at {self.address}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return PermissionError(f"{where} refused the auth token")
        if event not in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            return None
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.secure:
                return PermissionError(
                    f"{where} refused the auth token: it does not use one (connect without)"
                )
            return PermissionError(
                f"{where} refused the connection: it requires an auth token (auth_token=...)"
            )
        if self.secure:  # a wrong token derives a wrong server key: the engine hangs up
            return PermissionError(
                f"{where} refused the auth token: a wrong token, or the engine uses none"
            )
        # A CURVE server may hang up on a plain client before the mechanisms are compared.
        return PermissionError(
            f"{where} refused the connection (the ZMQ handshake failed, error {value}): "
            "it probably requires an auth token (auth_token=...)"
        )

    def events(self) -> list[tuple[int, int]]:
        """The monitor events waiting now, as ``(event, value)`` pairs."""
        assert self.monitor is not None
        events = []
        while True:
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return events
            events.append((int(msg["event"]), int(msg["value"])))

    def disconnected(self) -> bool:
        return any(event == zmq.EVENT_DISCONNECTED for event, _ in self.events())

    def close(self, linger_ms: int = 0) -> None:
        """Close both sockets; ``linger_ms``: how long queued frames may still go out (in
        the background: the shared context is never terminated, so nothing waits)."""
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


# -- the connection and its I/O thread --------------------------------------------------------


# Objects whose locks a forked child makes anew: a lock that another thread of the parent
# held at the fork stays held in the child forever (its use there must fail, not hang).
_after_fork: weakref.WeakSet = weakref.WeakSet()


def _reinit_locks() -> None:
    for obj in list(_after_fork):
        obj._new_locks()


os.register_at_fork(after_in_child=_reinit_locks)


class _Connection:
    """Both dealers of one client and the I/O thread that owns them.

    Caller side (any thread): ``submit``, ``send``, ``abort``, ``query``, ``close``.
    Everything a caller sends goes through the outbox; only the I/O thread touches sockets.
    ``abandon`` (the client object's finalizer) only sets a flag.

    The engine knows each submission by a wire id of its own (the caller's id and a
    number): a caller that gave up on a request may reuse its id at once, while the engine
    still ends the old one (whose late outputs find no receiver), and an id is free again
    as soon as its request finished here, before the engine has let it go.
    """

    def __init__(
        self, address: str, *, timeout: float, client_id: str | None, auth_token: str | None
    ) -> None:
        if client_id and len(client_id.encode()) > MAX_CLIENT_ID_BYTES:
            raise ValueError(f"client_id must be at most {MAX_CLIENT_ID_BYTES} bytes of UTF-8")
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        # Each connection routes under an id of its own, the caller's name plus a nonce: the
        # engine forgets a connection found gone (and drops what it still queues of it), so
        # a new connection under that name must never be taken for the old one. ("" is no
        # name: a random one.)
        self.routing_id = (
            f"{self.client_id}.{uuid.uuid4().hex[:8]}" if client_id else self.client_id
        )
        self.address = connectable(address)
        self.sinks: dict[str, Sink] = {}  # wire id -> where its deltas go
        self.live: dict[str, str] = {}  # caller's request id -> wire id, until it ends here
        self._wire_ids = itertools.count()
        self.queries: dict[int, Sink] = {}  # query id -> where the reply goes
        self.dead: str | None = None  # why the engine is gone, once it is
        self._query_ids = itertools.count()
        self._outbox: deque[bytes] = deque()
        # Guards _ending, the wake pipe and ``live``; reentrant: a stream dropped in a
        # reference cycle is closed by the collector in whatever thread runs it, maybe one
        # holding the lock in ``submit`` (its ``forget`` then takes it again).
        self._lock = threading.RLock()
        _after_fork.add(self)
        self._ending: tuple[type[Exception], str] | None = None  # set once: no more sends
        self._abandoned = False
        self.supervised = False  # a launcher in this process calls engine_died
        self._pid = os.getpid()
        deadline = _Deadline(timeout)
        hello = encoder.encode(Hello(self.routing_id))
        ctx = _context()
        dealers: list[_Dealer] = []
        try:
            dealers.append(_Dealer(ctx, self.address, self.routing_id, auth_token))
            info = dealers[0].handshake(hello, scheduler_reply_decoder(), deadline)
            if not isinstance(info, EngineInfo):
                raise ConnectionError(f"{self.address} answered hello with {type(info).__name__}")
            self.info = info
            self.output_address = output_address(self.address, info.output_address)
            dealers.append(_Dealer(ctx, self.output_address, self.routing_id, auth_token))
            dealers[1].handshake(hello, output_reply_decoder(), deadline)
        except BaseException:
            for dealer in dealers:
                dealer.close()
            raise
        self._requests, self._outputs = dealers
        limit = info.max_request_bytes // 2 if info.max_request_bytes else ABORT_CHUNK_BYTES
        self.abort_chunk_bytes = max(512, min(ABORT_CHUNK_BYTES, limit))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.thread = threading.Thread(
            target=self._run, name=f"mpengine-client-io-{self.client_id}", daemon=True
        )
        self.thread.start()

    # -- caller side ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """No more requests can be sent (closed, dropped, or the engine is gone)."""
        return self._ending is not None

    def _enqueue(self, frames: Iterable[bytes]) -> None:
        """Queue frames for the I/O thread and wake it; the caller holds the lock."""
        if self._pid != os.getpid():
            raise ClientClosedError("this client was created before a fork: make a new one")
        if self._ending is not None:
            kind, reason = self._ending
            raise kind(reason)
        self._outbox.extend(frames)
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread anyway
            os.write(self._wake_w, b"\0")

    def _encode(self, msg: msgspec.Struct) -> bytes:
        frame = encoder.encode(msg)
        limit = self.info.max_request_bytes
        if limit and len(frame) > limit:
            raise InvalidRequestError(
                f"request of {len(frame)} bytes exceeds the engine's max_request_bytes ({limit})",
                "too_large",
            )
        return frame

    def send(self, msg: msgspec.Struct) -> None:
        """Send one message to the scheduler."""
        frame = self._encode(msg)
        with self._lock:
            self._enqueue((frame,))

    def submit(self, request: AddRequest, sink: Sink) -> str:
        """Send a request; its deltas (or an exception) will be passed to ``sink``. Returns
        its wire id."""
        request_id = request.request_id
        wire_id = f"{request_id}#{next(self._wire_ids)}"
        frame = self._encode(msgspec.structs.replace(request, request_id=wire_id))
        with self._lock:
            if request_id in self.live:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self.live[request_id] = wire_id
            self.sinks[wire_id] = sink  # before the frame can go out
            try:
                self._enqueue((frame,))
            except BaseException:
                del self.sinks[wire_id], self.live[request_id]
                raise
        return wire_id

    def forget(self, request_id: str, wire_id: str) -> None:
        """Deliver nothing more for this request; its id is free again."""
        with self._lock:
            self.sinks.pop(wire_id, None)
            if self.live.get(request_id) == wire_id:
                del self.live[request_id]

    def abort_live(self, request_ids: Sequence[str]) -> None:
        """Abort the requests running under these ids of the caller's (unknown ones, and
        those already ended, are ignored)."""
        with self._lock:
            wire_ids = [w for r in request_ids if (w := self.live.get(r)) is not None]
        self.abort(wire_ids)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests (wire ids) on the engine (in frames of bounded size; their
        final deltas still come); nothing to do once the connection is closed."""
        if request_ids:
            with self._lock:
                if self._ending is None:
                    self._enqueue(abort_frames(request_ids, self.abort_chunk_bytes))

    def query(self, make: Callable[[int], msgspec.Struct], sink: Sink) -> int:
        """Send ``make(query_id)``; the engine's reply (or an exception) goes to ``sink``.
        The caller removes ``queries[query_id]`` when it stops waiting."""
        query_id = next(self._query_ids)
        frame = encoder.encode(make(query_id))
        with self._lock:
            self.queries[query_id] = sink
            try:
                self._enqueue((frame,))
            except BaseException:
                del self.queries[query_id]
                raise
        return query_id

    def close(self, timeout: float = 5.0) -> None:
        """Abort pending requests (they fail with ``ClientClosedError``) and stop the
        I/O thread, waiting for it at most ``timeout`` seconds."""
        self._end(ClientClosedError, "the client was closed")
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            if self.thread.is_alive():
                logger.warning("client %s: the I/O thread did not stop in time", self.client_id)

    def engine_died(self, reason: str) -> None:
        """The launcher saw the engine die (any thread): fail everything pending now."""
        self._end(EngineDeadError, reason)

    def abandon(self) -> None:
        """The client object was garbage-collected. Runs in whatever thread the collector
        runs in, maybe inside a send holding the lock: only sets a flag for the I/O thread."""
        self._abandoned = True

    def _new_locks(self) -> None:
        self._lock = threading.RLock()

    def _end(self, kind: type[Exception], reason: str) -> None:
        with self._lock:
            if self._ending is None:
                self._ending = (kind, reason)
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"\0")

    # -- the I/O thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            logger.exception("client %s: the I/O thread failed", self.client_id)
            self._end(EngineDeadError, f"the client's I/O thread failed: {exc!r}")
        finally:
            self._finish()

    def _serve(self) -> None:
        requests, outputs = self._requests, self._outputs
        replies, deltas = scheduler_reply_decoder(), output_reply_decoder()
        poller = zmq.Poller()
        for sock in (requests.sock, outputs.sock, requests.monitor, outputs.monitor):
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            if self._abandoned:  # (its finalizer also runs at exit, the client in use)
                self._end(
                    ClientClosedError,
                    "the client was not closed, and was garbage-collected or the program exits",
                )
            if self._ending is not None:
                return
            events = dict(poller.poll(POLL_MS))
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            self._flush()
            if outputs.sock in events:
                self._receive(outputs.sock, deltas, self._on_output)
            if requests.sock in events:
                self._receive(requests.sock, replies, self._on_reply)
            if (requests.monitor in events and requests.disconnected()) or (
                outputs.monitor in events and outputs.disconnected()
            ):
                if self.supervised:
                    self._await_launcher()
                self._end(EngineDeadError, "the engine closed its connection (it stopped or died)")
            self._flush()  # aborts of requests whose delivery failed

    def _await_launcher(self) -> None:
        """Wait (a little) for the launcher's ``engine_died``, which says why."""
        until = time.monotonic() + LAUNCHER_WORD_S
        while self._ending is None and (left := until - time.monotonic()) > 0:
            select.select([self._wake_r], [], [], left)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):  # (also woken by sends meanwhile)
                    pass

    def _flush(self) -> bool:
        """Send the outbox to the scheduler; whether anything was sent."""
        sent = False
        while self._outbox:
            try:
                self._requests.sock.send(self._outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return sent  # retried on the next turn
            except zmq.ZMQError as exc:
                logger.warning("client %s: a frame could not be sent: %s", self.client_id, exc)
            self._outbox.popleft()
            sent = True
        return sent

    def _receive(
        self, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, handle: Callable[[Any], None]
    ) -> None:
        """Handle the frames waiting on ``sock``; one that fails fails only its requests."""
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._undecodable(frame, exc)
            except Exception:
                logger.exception("client %s: failed to handle a frame", self.client_id)

    def _undecodable(self, frame: bytes, exc: Exception) -> None:
        request_ids, query_ids = _ids_in_bad_frame(frame)
        logger.warning(
            "client %s: dropped a frame from the engine that does not decode (%s); "
            "failing requests %s and queries %s",
            self.client_id,
            exc,
            request_ids,
            query_ids,
        )
        error = ProtocolError(f"a reply from the engine could not be decoded: {exc}")
        for request_id in request_ids:
            self._deliver(request_id, error, final=True)
            self._outbox.extend(abort_frames([request_id], self.abort_chunk_bytes))
        for query_id in query_ids:
            if (sink := self.queries.pop(query_id, None)) is not None:
                self._call(sink, error)

    def _on_output(self, msg: object) -> None:
        if isinstance(msg, OutputBatch):
            for delta in msg.deltas:
                self._deliver(delta.request_id, delta)
        elif isinstance(msg, RequestError):
            self._on_error(msg)

    def _on_reply(self, msg: object) -> None:
        if isinstance(msg, RequestError):
            self._on_error(msg)
        elif isinstance(msg, EngineStats | TokenizerFile) and (
            sink := self.queries.pop(msg.query_id, None)
        ):
            self._call(sink, msg)

    def _on_error(self, error: RequestError) -> None:
        if error.request_id:
            self._deliver(error.request_id, _request_error(error), final=True)
        else:
            logger.warning("client %s: the engine says: %s", self.client_id, error.message)

    def _deliver(self, request_id: str, item: object, final: bool = False) -> None:
        sink = self.sinks.pop(request_id, None) if final else self.sinks.get(request_id)
        if sink is not None and not self._call(sink, item):
            # Nobody can receive this request's outputs (its event loop is closed...).
            logger.warning("client %s: aborting request %r", self.client_id, request_id)
            self.forget(request_id.rpartition("#")[0], request_id)
            self._outbox.extend(abort_frames([request_id], self.abort_chunk_bytes))

    def _call(self, sink: Sink, item: object) -> bool:
        try:
            sink(item)
            return True
        except Exception:
            logger.warning("client %s: a receiver failed", self.client_id, exc_info=True)
            return False

    def _finish(self) -> None:
        """Last act of the I/O thread: abort what is pending (if the engine lives), fail
        every waiter, close the sockets."""
        with self._lock:
            if self._ending is None:
                self._ending = (EngineDeadError, "the client's I/O thread stopped")
            os.close(self._wake_r)
            os.close(self._wake_w)
        kind, reason = self._ending
        sinks, self.sinks = self.sinks, {}
        queries, self.queries = self.queries, {}
        linger = 0
        if kind is EngineDeadError:
            self.dead = reason
            self._outbox.clear()
        else:
            self._outbox.extend(abort_frames(list(sinks), self.abort_chunk_bytes))
            if self._flush():
                linger = ABORT_LINGER_MS
        for sink in (*sinks.values(), *queries.values()):
            self._call(sink, kind(reason))
        self._requests.close(linger)
        self._outputs.close()


# -- waiting for replies, sync and async ------------------------------------------------------


def _threadsafe_put(loop: asyncio.AbstractEventLoop, items: asyncio.Queue) -> Sink:
    """A sink for the I/O thread that puts into an asyncio queue (raises RuntimeError once
    the loop is closed, which makes the I/O thread drop and abort the request)."""
    return lambda item: loop.call_soon_threadsafe(items.put_nowait, item)


async def _within(awaitable: Any, deadline: _Deadline, what: str) -> Any:
    remaining = deadline.remaining()
    if remaining is None:
        return await awaitable
    try:
        if sys.version_info >= (3, 11):
            # (wait_for before 3.12 loses a cancellation of the caller that comes in the
            # loop turn its awaitable finishes in: the caller then ran on to the end.)
            async with asyncio.timeout(remaining):
                return await awaitable
        return await asyncio.wait_for(awaitable, remaining)
    except asyncio.TimeoutError:
        raise deadline.error(what) from None


def _unwrap(item: T | BaseException) -> T:
    if isinstance(item, BaseException):
        raise item
    return item


def _query(conn: _Connection, make: Callable[[int], msgspec.Struct], timeout: float) -> Any:
    replies: queue.SimpleQueue = queue.SimpleQueue()
    query_id = conn.query(make, replies.put)
    try:
        return _unwrap(replies.get(timeout=_Deadline(timeout).remaining()))
    except queue.Empty:
        raise _Deadline(timeout).error(f"no reply to {make.__name__}") from None
    finally:
        conn.queries.pop(query_id, None)


async def _aquery(conn: _Connection, make: Callable[[int], msgspec.Struct], timeout: float) -> Any:
    replies: asyncio.Queue = asyncio.Queue()
    query_id = conn.query(make, _threadsafe_put(asyncio.get_running_loop(), replies))
    try:
        deadline = _Deadline(timeout)
        return _unwrap(await _within(replies.get(), deadline, f"no reply to {make.__name__}"))
    finally:
        conn.queries.pop(query_id, None)


class _Request:
    """One submitted request seen from its caller."""

    def __init__(self, conn: _Connection, request: AddRequest, sink: Sink) -> None:
        self.conn = conn
        self.request_id = request.request_id
        self.assembly = _Assembly(request)
        self.failed = False
        # Final deltas (or the error) received by the I/O thread: once all have, the
        # request has ended on the engine, and a late reader still gets what is left.
        self._finals_due = self.assembly.num_open

        def receive(item: OutputDelta | BaseException) -> None:
            if isinstance(item, BaseException):
                self._finals_due = 0
            elif item.finish_reason is not None:
                self._finals_due -= 1
            sink(item)

        self.wire_id = conn.submit(request, receive)

    @property
    def ended(self) -> bool:
        """Every final delta has arrived here (maybe not read yet)."""
        return self._finals_due <= 0

    @property
    def finished(self) -> bool:
        return self.assembly.output.finished

    @property
    def open(self) -> bool:
        """Still running on the engine as far as we know."""
        return not self.finished and not self.failed

    def _take(self, item: OutputDelta | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.failed = True
            self.conn.forget(self.request_id, self.wire_id)
            raise item
        delta = self.assembly.add(item)
        if delta.finished:
            self.conn.forget(self.request_id, self.wire_id)
        return delta

    def cancel(self) -> None:
        """The caller stopped waiting: forget the request, abort it if still running."""
        self.conn.forget(self.request_id, self.wire_id)
        if self.open:
            self.conn.abort([self.wire_id])


class _SyncRequest(_Request):
    def __init__(self, conn: _Connection, request: AddRequest) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(conn, request, self.items.put)

    def next(self, deadline: _Deadline) -> RequestOutput:
        try:
            item = self.items.get(timeout=deadline.remaining())
        except queue.Empty:
            raise deadline.error(f"request {self.request_id!r} aborted: not finished") from None
        return self._take(item)

    def result(self, deadline: _Deadline) -> RequestOutput:
        while not self.finished:
            self.next(deadline)
        return self.assembly.output


class _BatchRequest(_Request):
    """The ``index``-th request of a batch call: its deltas go, as ``(request, delta)``, to
    the batch's one queue through ``put``."""

    def __init__(self, conn: _Connection, request: AddRequest, put: Sink, index: int) -> None:
        self.put = put
        self.index = index
        super().__init__(conn, request, self._put)

    def _put(self, item: OutputDelta | BaseException) -> None:
        self.put((self, item))


def _wait_batch(
    events: queue.SimpleQueue,
    waited: Sequence[_BatchRequest],
    deadline: _Deadline,
    finished: Callable[[_BatchRequest], object] | None = None,
    first: bool = False,
) -> list[_BatchRequest]:
    """Take a batch's deltas, in arrival order, until every request of ``waited`` has
    finished (``first``: until any request of the batch has), each finished one passed to
    ``finished``; return those that finished meanwhile. The first refused or failed one
    raises at once, whichever it is, not once those before it are done."""
    left = {id(r) for r in waited if not r.finished}
    ended: list[_BatchRequest] = []
    while (left or first) and not (first and ended):
        try:
            request, item = events.get(timeout=deadline.remaining())
        except queue.Empty:
            what = f"{len(left)} requests" if left else "the batch's requests"
            raise deadline.error(f"{what} aborted: not finished") from None
        request._take(item)
        if request.finished:
            left.discard(id(request))
            ended.append(request)
            if finished is not None:
                finished(request)
    return ended


async def _await_batch(
    events: asyncio.Queue,
    waited: Sequence[_BatchRequest],
    deadline: _Deadline,
    finished: Callable[[_BatchRequest], object] | None = None,
    first: bool = False,
) -> list[_BatchRequest]:
    """``_wait_batch`` on an event loop."""
    left = {id(r) for r in waited if not r.finished}
    ended: list[_BatchRequest] = []
    while (left or first) and not (first and ended):
        what = f"{len(left)} requests" if left else "the batch's requests"
        request, item = await _within(events.get(), deadline, f"{what} aborted: not finished")
        request._take(item)
        if request.finished:
            left.discard(id(request))
            ended.append(request)
            if finished is not None:
                finished(request)
    return ended


def _reporting_embeddings(
    on_output: Callable[[int, EmbeddingOutput], object] | None,
) -> Callable[[_BatchRequest], object] | None:
    """``finished`` for ``_wait_batch``: ``on_output(index, embedding)``."""
    if on_output is None:
        return None
    return lambda request: on_output(request.index, request.assembly.embedding_output())


class _AsyncRequest(_Request):
    def __init__(self, conn: _Connection, request: AddRequest) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        super().__init__(conn, request, _threadsafe_put(asyncio.get_running_loop(), self.items))

    async def next(self, deadline: _Deadline) -> RequestOutput:
        what = f"request {self.request_id!r} aborted: not finished"
        return self._take(await _within(self.items.get(), deadline, what))

    async def result(self, deadline: _Deadline) -> RequestOutput:
        while not self.finished:
            await self.next(deadline)
        return self.assembly.output


# -- the public clients ----------------------------------------------------------------------


class _Window:
    """The requests of one batch call in flight at once. The engine refuses a request
    (``overloaded``) once ``max_waiting_requests`` requests or ``max_waiting_tokens``
    prompt tokens wait for admission; a batch keeps at most a quarter of the tokens in
    flight, and as many requests as a step takes (``max_num_seqs``, within half the queue)
    or a quarter of the queue, whichever is more (other clients share the queue: four big
    batch calls fit the default one at once), but no more than four steps take. It submits
    the rest as earlier ones finish, whichever they are (a long one does not hold back the
    others), marked ``continues`` (a draining engine lets the call finish, and the engine
    refuses them only past twice its bounds)."""

    def __init__(self, info: EngineInfo) -> None:
        self.max_requests = self.max_tokens = 1 << 62  # an engine that does not say
        if info.max_waiting_requests:
            queue, seqs = info.max_waiting_requests, info.max_num_seqs
            # A step's worth at least (within half the queue), else a quarter of the queue.
            self.max_requests = max(1, min(4 * seqs, max(queue // 4, min(seqs, queue // 2))))
            self.max_tokens = max(1, info.max_waiting_tokens // 4)
        self.inflight: dict[int, int] = {}  # id of a request in flight -> its prompt tokens
        self.tokens = 0
        self.released = 0  # requests that finished and left the window

    def admits(self, request: AddRequest) -> bool:
        """Whether ``request`` may go now; else one in flight must finish first."""
        size = len(request.prompt_token_ids)
        fits = len(self.inflight) < self.max_requests and self.tokens + size <= self.max_tokens
        return not self.inflight or fits

    def add(self, request: _BatchRequest, size: int) -> None:
        self.inflight[id(request)] = size
        self.tokens += size

    def release(self, finished: list[_BatchRequest]) -> None:
        for request in finished:
            size = self.inflight.pop(id(request), None)
            if size is not None:
                self.tokens -= size
                self.released += 1


def _priorities(priority: int | Sequence[int], count: int) -> list[int]:
    """One priority per prompt: the same for all, or a sequence of them (each is checked
    where its request is made)."""
    one = not isinstance(priority, Sequence) or isinstance(priority, str | bytes)
    priorities = [priority] * count if one else list(priority)  # type: ignore[arg-type]
    if len(priorities) != count:
        raise ValueError(f"{count} prompts and {len(priorities)} priorities: give one per prompt")
    return priorities


def _check_priority(priority: object) -> None:
    in_range = isinstance(priority, int) and -INT32_MAX - 1 <= priority <= INT32_MAX
    if not in_range or isinstance(priority, bool):
        raise InvalidRequestError(f"priority ({priority!r}) must be an integer within int32")


def _check_counts(prompts: Sequence, params: Sequence, request_ids: Sequence) -> None:
    if not len(params) == len(request_ids) == len(prompts):
        raise ValueError(
            f"{len(prompts)} prompts, {len(params)} parameter sets and {len(request_ids)} "
            "request ids: give one of each per prompt"
        )


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


@dataclass(frozen=True, slots=True)
class _ChatOptions:
    """How ``chat`` renders a conversation (its keyword arguments, as vLLM's ``LLM.chat``)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


def _messages_of(conversation: object) -> list:
    """The messages of a conversation, as far as they are dicts (to measure their text)."""
    if not isinstance(conversation, Sequence):
        return []
    return [m for m in conversation if isinstance(m, Mapping)]


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


class _ClientBase:
    def __init__(
        self,
        address: str,
        *,
        timeout: float = 30.0,
        client_id: str | None = None,
        auth_token: str | None = None,
    ) -> None:
        self._conn = _Connection(
            address, timeout=timeout, client_id=client_id, auth_token=auth_token
        )
        self._timeout = timeout
        self._tokenizer: Tokenizer | None = None
        self._chat_files: dict[str, bytes] = {}  # what the engine shared of its chat template
        self._chat_templates: dict[str | None, ChatTemplate] = {}  # by template (None: model's)
        self._tokenizer_lock = threading.Lock()
        self._tokenizer_fetch: asyncio.Future | None = None  # AsyncClient's fetch under way
        _after_fork.add(self)
        self._ids = itertools.count()
        # Dropped without close(): the I/O thread aborts what is pending and stops. (The
        # callbacks hold the connection, never this object.)
        weakref.finalize(self, self._conn.abandon)
        conn = weakref.ref(self._conn)

        def engine_died(reason: str) -> None:
            if (c := conn()) is not None:
                c.engine_died(reason)

        self._engine_died = engine_died  # for the Engine that made this client

    def _new_locks(self) -> None:
        self._tokenizer_lock = threading.Lock()

    @property
    def info(self) -> EngineInfo:
        """What the engine said about itself at the handshake."""
        return self._conn.info

    @property
    def client_id(self) -> str:
        return self._conn.client_id

    def tokenize(self, text: str, *, max_length: int | None = None) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (fetched from the engine once
        per client, so this works from any host), special tokens added as the model's
        tokenizer frames an input. ``max_length`` truncates the text's tokens so that the
        framed whole fits (as ``transformers``' ``truncation=True``)."""
        tokenizer = self._fetch_tokenizer()
        if max_length is None:
            return encode_texts(tokenizer, [text])[0]
        (encoding,) = tokenizer.encode_batch([text], add_special_tokens=False)
        room = max(0, max_length - tokenizer.num_special_tokens_to_add(False))
        if len(encoding.ids) > room:
            encoding.truncate(room)
        return tokenizer.post_process(encoding).ids

    def _fetch_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer, fetched on first use."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._adopt(_query(self._conn, TokenizerQuery, self._timeout))
        return self._tokenizer  # type: ignore[return-value]

    def _adopt(self, reply: TokenizerFile) -> None:
        """Keep what the engine shared: its tokenizer and its chat template's files (one
        fetch serves both: the engine answers a client's tokenizer queries a few times)."""
        from tokenizers import Tokenizer

        self._chat_files = dict(reply.chat_files)
        if self._tokenizer is not None:
            return
        if not reply.data:
            raise RuntimeError("the engine has no tokenizer.json to share: send token ids")
        self._tokenizer = as_transformers_encodes(Tokenizer.from_str(reply.data.decode()))

    def _chat_template(self, source: str | None) -> ChatTemplate:
        """The model's chat template, or ``source`` (a template, or a file holding one);
        compiled once per client."""
        from mpengine.chat_template import ChatTemplate, load_chat_template

        template = self._chat_templates.get(source)
        if template is None:
            try:
                text = load_chat_template(source) if source is not None else None
            except ValueError as exc:
                raise InvalidRequestError(f"chat_template: {exc}") from None
            template = ChatTemplate.from_files(self._chat_files, text)
            if len(self._chat_templates) >= 8:  # (templates given per call: keep a few)
                self._chat_templates.clear()
            self._chat_templates[source] = template
        return template

    def _chat_ids(self, conversation: Conversation, options: _ChatOptions) -> list[int]:
        """The token ids of ``conversation`` rendered by the chat template (which holds the
        special tokens: none are added, as vLLM's ``LLM.chat`` encodes it)."""
        from mpengine.chat_template import ChatTemplateError

        tokenizer = self._fetch_tokenizer()
        template = self._chat_template(options.chat_template)
        extra = dict(options.chat_template_kwargs or {})
        if options.tools is not None:
            extra.setdefault("tools", options.tools)
        # As vLLM, chat_template_kwargs may say add_generation_prompt too, and win.
        prompted = bool(extra.pop("add_generation_prompt", options.add_generation_prompt))
        continued = options.continue_final_message
        try:
            if not conversation:
                raise ChatTemplateError("messages is empty: give at least one message")
            messages = template.messages(conversation)
            text = template.render(messages, prompted and not continued, continued, extra)
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc)) from None
        return encode_texts(tokenizer, [text], add_special_tokens=False)[0]

    def _request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        streaming: bool = False,
        priority: int = 0,
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
            request_id, token_array(ids), params, arrival_time=time.time(), priority=priority
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


class Client(_ClientBase):
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
        deadline = _Deadline(timeout)
        add = self._request(prompt, params, request_id, True, priority)
        request = _SyncRequest(self._conn, add)
        try:
            while not request.finished:
                if deadline.passed and not request.ended:  # (a slow reader always finds one)
                    raise deadline.error(f"request {request.request_id!r} aborted: not finished")
                yield request.next(deadline)
        finally:
            request.cancel()

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
        return self.generate_many(
            [prompt], params, timeout=timeout, request_ids=[request_id], priority=priority
        )[0]

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
        requests = self._run_many(
            lambda prompt, p, rid, prio: self._request(prompt, p, rid, priority=prio),
            prompts,
            _per_prompt(params, SamplingParams, len(prompts)),
            request_ids,
            timeout,
            priority,
        )
        return [r.assembly.output for r in requests]

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
        options = _ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        return self._chat_ids(messages, options)

    @overload
    def chat(
        self,
        messages: Conversation,
        params: SamplingParams | None = None,
        **kwargs: Any,
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
        conversations, batch = _conversations(messages)
        options = _ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        prompts = [self._chat_ids(conversation, options) for conversation in conversations]
        if not batch:
            return self.generate(
                prompts[0],
                params,
                request_id=request_id,
                timeout=timeout,
                priority=priority,  # type: ignore[arg-type]
            )
        if request_id is not None:
            raise TypeError("request_id names one request: a batch of conversations gets fresh ids")
        return self.generate_many(prompts, params, timeout=timeout, priority=priority)

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
        conversations, batch = _conversations(messages)
        if batch:
            raise InvalidRequestError("chat_stream takes one conversation, not a batch")
        options = _ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        ids = self._chat_ids(conversations[0], options)
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
        return self.embed_many(
            [prompt], params, timeout=timeout, request_ids=[request_id], priority=priority
        )[0]

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
        requests = self._run_many(
            self._embed_request,
            prompts,
            _per_prompt(params, PoolingParams, len(prompts)),
            request_ids,
            timeout,
            priority,
            _reporting_embeddings(on_output),
        )
        return [r.assembly.embedding_output() for r in requests]

    def _run_many(
        self,
        make: Callable[[Prompt, Any, str | None, int], AddRequest],
        prompts: Sequence[Prompt],
        params: list,
        request_ids: Sequence[str | None] | None,
        timeout: float | None,
        priority: int | Sequence[int],
        finished: Callable[[_BatchRequest], object] | None = None,
    ) -> list[_BatchRequest]:
        """Submit ``make(prompt, params, request id, priority)`` for every prompt; wait for
        all of them to finish (one deadline for all; each passed to ``finished`` as it does)
        and return them in order; on any error or the deadline abort the unfinished."""
        ids = request_ids or [None] * len(prompts)
        _check_counts(prompts, params, ids)
        priorities = _priorities(priority, len(prompts))
        deadline = _Deadline(timeout)
        events: queue.SimpleQueue = queue.SimpleQueue()
        requests: list[_BatchRequest] = []
        window = _Window(self.info)
        try:
            for prompt, p, rid, prio in zip(prompts, params, ids, priorities, strict=True):
                request = make(prompt, p, rid, prio)
                while not window.admits(request):  # wait for one in flight to finish
                    window.release(_wait_batch(events, (), deadline, finished, first=True))
                request.continues = window.released > 0
                requests.append(_BatchRequest(self._conn, request, events.put, len(requests)))
                window.add(requests[-1], len(request.prompt_token_ids))
            _wait_batch(events, requests, deadline, finished)
            return requests
        finally:
            for r in requests:
                self._conn.forget(r.request_id, r.wire_id)
            self._conn.abort([r.wire_id for r in requests if r.open])

    def stats(self, timeout: float = 10.0) -> EngineStats:
        """The scheduler's counters: queues, free blocks, preemptions..."""
        return _query(self._conn, StatsQuery, timeout)


class AsyncClient(_ClientBase):
    """asyncio client over the same connection machinery (the I/O thread hands deltas to
    the event loop each request was made from; one client may serve several loops, one
    after the other or at once). Arguments as for ``Client``."""

    async def _ensure_tokenizer(self, prompt: Prompt) -> None:
        """Fetch the tokenizer without blocking the event loop (``tokenize`` would); calls
        that come while it is on its way wait for that one fetch (the file can be megabytes)."""
        if not isinstance(prompt, str) or self._tokenizer is not None:
            return
        fetch = self._tokenizer_fetch
        if fetch is None or fetch.get_loop() is not asyncio.get_running_loop():
            fetch = self._tokenizer_fetch = asyncio.ensure_future(
                _aquery(self._conn, TokenizerQuery, self._timeout)
            )
        try:
            reply = await asyncio.shield(fetch)
        finally:
            if fetch.done() and self._tokenizer_fetch is fetch:
                self._tokenizer_fetch = None  # a failed fetch is tried again by the next call
        self._adopt(reply)

    async def _arequest(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        streaming: bool = False,
        priority: int = 0,
    ) -> _AsyncRequest:
        await self._ensure_tokenizer(prompt)
        request = await off_the_loop(
            [prompt], lambda: self._request(prompt, params, request_id, streaming, priority)
        )
        return _AsyncRequest(self._conn, request)

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
        deadline = _Deadline(timeout)
        request = await self._arequest(prompt, params, request_id, True, priority)
        try:
            while not request.finished:
                if deadline.passed and not request.ended:  # (a slow reader always finds one)
                    raise deadline.error(f"request {request.request_id!r} aborted: not finished")
                yield await request.next(deadline)
        finally:
            request.cancel()

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
        deadline = _Deadline(timeout)
        request = await self._arequest(prompt, params, request_id, priority=priority)
        try:
            return await request.result(deadline)
        finally:
            request.cancel()

    async def _achat_ids(self, conversations: list, options: _ChatOptions) -> list[list[int]]:
        """``_chat_ids`` of each conversation, rendered off the event loop when long."""
        from mpengine.chat_template import message_texts

        await self._ensure_tokenizer("")
        texts = [text for c in conversations for text in message_texts(_messages_of(c))]
        return await off_the_loop(
            texts, lambda: [self._chat_ids(c, options) for c in conversations]
        )

    @overload
    async def chat(
        self,
        messages: Conversation,
        params: SamplingParams | None = None,
        **kwargs: Any,
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
        conversations, batch = _conversations(messages)
        options = _ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        prompts = await self._achat_ids(conversations, options)
        if not batch:
            return await self.generate(
                prompts[0],
                params,
                request_id=request_id,
                timeout=timeout,
                priority=priority,  # type: ignore[arg-type]
            )
        if request_id is not None:
            raise TypeError("request_id names one request: a batch of conversations gets fresh ids")
        return await self.generate_many(prompts, params, timeout=timeout, priority=priority)

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
        conversations, batch = _conversations(messages)
        if batch:
            raise InvalidRequestError("chat_stream takes one conversation, not a batch")
        options = _ChatOptions(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
        (ids,) = await self._achat_ids(conversations, options)
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
        out = await self.embed_many(
            [prompt], params, timeout=timeout, request_ids=[request_id], priority=priority
        )
        return out[0]

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
        requests = await self._run_many(
            self._embed_request,
            prompts,
            _per_prompt(params, PoolingParams, len(prompts)),
            request_ids,
            timeout,
            priority,
            _reporting_embeddings(on_output),
        )
        return [r.assembly.embedding_output() for r in requests]

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
        requests = await self._run_many(
            lambda prompt, p, rid, prio: self._request(prompt, p, rid, priority=prio),
            prompts,
            _per_prompt(params, SamplingParams, len(prompts)),
            request_ids,
            timeout,
            priority,
        )
        return [r.assembly.output for r in requests]

    async def _run_many(
        self,
        make: Callable[[Prompt, Any, str | None, int], AddRequest],
        prompts: Sequence[Prompt],
        params: list,
        request_ids: Sequence[str | None] | None,
        timeout: float | None,
        priority: int | Sequence[int],
        finished: Callable[[_BatchRequest], object] | None = None,
    ) -> list[_BatchRequest]:
        """``Client._run_many`` on an event loop (the requests are made, texts tokenized,
        off it)."""
        ids = request_ids or [None] * len(prompts)
        _check_counts(prompts, params, ids)
        priorities = _priorities(priority, len(prompts))
        deadline = _Deadline(timeout)
        events: asyncio.Queue = asyncio.Queue()
        requests: list[_BatchRequest] = []
        put = _threadsafe_put(asyncio.get_running_loop(), events)
        window = _Window(self.info)
        try:
            if any(isinstance(prompt, str) for prompt in prompts):
                await self._ensure_tokenizer("")
            made = await off_the_loop(
                prompts,
                lambda: [
                    make(prompt, p, rid, prio)
                    for prompt, p, rid, prio in zip(prompts, params, ids, priorities, strict=True)
                ],
            )
            for request in made:
                while not window.admits(request):  # wait for one in flight to finish
                    window.release(await _await_batch(events, (), deadline, finished, first=True))
                request.continues = window.released > 0
                requests.append(_BatchRequest(self._conn, request, put, len(requests)))
                window.add(requests[-1], len(request.prompt_token_ids))
            await _await_batch(events, requests, deadline, finished)
            return requests
        finally:
            for r in requests:
                r.cancel()

    async def stats(self, timeout: float = 10.0) -> EngineStats:
        """The scheduler's counters: queues, free blocks, preemptions..."""
        return await _aquery(self._conn, StatsQuery, timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
