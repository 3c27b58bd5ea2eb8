"""The engine's two doors, shared by every runtime.

``FrontDoor`` (scheduler side): client frames in, scheduler calls and replies out. A bad
frame or a rejected request gets a ``RequestError`` for that request only; nothing a client
sends can stop the loop. Request ids are scoped to the client that sent them. Replies a
client has not read yet wait for it, in order and bounded (``_reply``).

``OutputDoor`` (output processor side): greets clients and streams their deltas. It never
blocks on a client: one that is gone has its requests aborted silently (those still queued
in the scheduler too, which the next feedback tells); one that stops reading until its
queue reaches ``client_send_hwm`` has its requests aborted too, and the final deltas (with
what it had not received) wait in a small backlog until it reads again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from mpengine.config import EngineConfig
from mpengine.protocol import (
    CHAT_TEMPLATE_FILES,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    EngineInfo,
    EngineStats,
    Hello,
    OutputBatch,
    OutputDelta,
    RequestError,
    StageTimes,
    StatsQuery,
    TokenizerFile,
    TokenizerQuery,
    client_request_decoder,
    encoder,
)
from mpengine.runtime.edges import Edge, Sent
from mpengine.scheduler import RequestRejected, Scheduler

TOKENIZER_REPLIES = 4  # tokenizer files sent to one client at most
TOKENIZER_CLIENTS = 4096  # clients whose tokenizer replies are counted (the latest ones)
MAX_PENDING_REPLY_BYTES = 64 << 20  # replies kept for one client that does not read yet
BACKLOG_POLL_S = 0.002  # how soon kept replies are tried again
# How long a restarted output processor keeps the deltas of clients not connected (yet):
# theirs connect again within a second or so.
CLIENTS_RETURN_S = 10.0
BACKLOG_STALL_S = 60.0  # a client that reads none of them for this long gets them no more

logger = logging.getLogger(__name__)


def check_hello(hello: Hello) -> str | None:
    """Why a client's greeting is refused, or None."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (
            f"protocol version {hello.protocol_version} is not supported: this engine speaks "
            f"version {PROTOCOL_VERSION} (upgrade the client library)"
        )
    return None


@dataclass(slots=True)
class _Backlog:
    """Replies kept for one client: their bytes, since when it has read none of them, and
    whether it passed the byte bound."""

    since: float
    replies: deque[bytes] = field(default_factory=deque)
    size: int = 0
    dropping: bool = False


class FrontDoor:
    def __init__(
        self,
        edge: Edge,
        scheduler: Scheduler,
        info: EngineInfo,
        stage_times: Callable[[], dict[str, StageTimes]] | None = None,
    ) -> None:
        self.edge = edge
        self.scheduler = scheduler
        self.info = info
        self.stage_times = stage_times  # each stage's step breakdown, for stats replies
        self.decoder = client_request_decoder()
        self._tokenizer_file: tuple[bytes, dict[str, bytes]] | None = None
        # Tokenizer replies per client (the most recent clients): one is all a client needs,
        # and each can be megabytes queued for a client that does not read.
        self._tokenizer_sent: OrderedDict[bytes, int] = OrderedDict()
        # Replies waiting for clients that read slower than they come (see _reply).
        self._backlog: dict[bytes, _Backlog] = {}

    def serve(self, timeout_s: float) -> int:
        """Handle every waiting client frame (waiting up to ``timeout_s`` for one, less
        while replies wait for clients to read)."""
        if self._backlog:
            self._flush()
            timeout_s = min(timeout_s, BACKLOG_POLL_S)
        frames = self.edge.receive(timeout_s)
        for client_id, frame in frames:
            self.handle(client_id, frame)
        return len(frames)

    def handle(self, client_id: bytes, frame: bytes) -> None:
        if len(frame) > self.edge.max_frame_bytes:
            message = (
                f"request of {len(frame)} bytes exceeds max_request_bytes "
                f"({self.edge.max_frame_bytes})"
            )
            self._reply(client_id, self.edge.error_for(frame, message))
            return
        try:
            msg = self.decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reply(client_id, self.edge.error_for(frame, exc))
            return
        try:
            client = client_id.decode()
        except UnicodeDecodeError:
            # Outputs are routed by this id from the output processor: it must be text.
            message = "the client's routing id must be UTF-8 text (set zmq.ROUTING_ID)"
            self._reply(client_id, self.edge.error_for(frame, message, "invalid"))
            return
        match msg:
            case AddRequest():
                try:
                    self.scheduler.add_request(msg, client)
                except RequestRejected as exc:
                    self._reply(client_id, RequestError(msg.request_id, str(exc), exc.kind))  # type: ignore[arg-type]
            case Abort():
                self.scheduler.abort(client, msg.request_ids)
            case Hello():
                refused = check_hello(msg)
                self._reply(client_id, RequestError("", refused) if refused else self.info)
            case StatsQuery():
                stages = self.stage_times() if self.stage_times else {}
                stats = EngineStats(query_id=msg.query_id, **self.scheduler.stats(), stages=stages)
                self._reply(client_id, stats)
            case TokenizerQuery():
                sent = self._tokenizer_sent.pop(client_id, 0)
                self._tokenizer_sent[client_id] = sent + 1
                if len(self._tokenizer_sent) > TOKENIZER_CLIENTS:
                    self._tokenizer_sent.popitem(last=False)
                if sent >= TOKENIZER_REPLIES:  # a client fetches it once: not answered
                    logger.debug("%r asked for the tokenizer %d times", client_id, sent + 1)
                    return
                data, chat_files = self._tokenizer()
                self._reply(client_id, TokenizerFile(msg.query_id, data, chat_files))

    def _reply(self, client_id: bytes, msg: msgspec.Struct) -> None:
        """Send ``msg``, or keep it (in order) until the client reads: a refusal dropped
        left its request unanswered forever (the HTTP server, one client of the engine,
        lost 81 of 2,836 refusals of a 9,000-request burst). A client that holds
        ``MAX_PENDING_REPLY_BYTES`` unread gets nothing more kept."""
        data = encoder.encode(msg)
        backlog = self._backlog.get(client_id)
        if backlog is None:
            if self.edge.send(client_id, data) is not Sent.FULL:
                return  # (sent, or the client is gone)
            backlog = self._backlog[client_id] = _Backlog(since=time.monotonic())
        if backlog.size + len(data) > MAX_PENDING_REPLY_BYTES:
            if not backlog.dropping:  # (once: a flood of them is one line)
                backlog.dropping = True
                logger.warning("dropping replies for %r: it does not read them", client_id)
            return
        backlog.replies.append(data)
        backlog.size += len(data)

    def _flush(self) -> None:
        """Send what waits for clients, as far as they read; forget what waits for a client
        that read none of it for ``BACKLOG_STALL_S`` (gone without a word, or stuck)."""
        now = time.monotonic()
        for client_id, backlog in list(self._backlog.items()):
            replies = backlog.replies
            before = len(replies)
            while replies:
                sent = self.edge.send(client_id, replies[0])
                if sent is Sent.FULL:
                    break
                backlog.size -= len(replies.popleft())
                if sent is Sent.GONE:
                    replies.clear()
            if len(replies) < before:
                backlog.since = now
            elif now - backlog.since > BACKLOG_STALL_S:
                logger.warning(
                    "dropped %d replies for %r: it read none for %.0f s",
                    len(replies),
                    client_id,
                    BACKLOG_STALL_S,
                )
                replies.clear()
            if not replies:
                del self._backlog[client_id]

    def _tokenizer(self) -> tuple[bytes, dict[str, bytes]]:
        """The engine's ``tokenizer.json`` (empty when it has none to share) and the files
        its chat template needs (those it has)."""
        if self._tokenizer_file is None:
            directory = Path(self.info.tokenizer)
            try:
                data = (directory / "tokenizer.json").read_bytes()
            except OSError as exc:
                logger.warning("cannot share the tokenizer: %s", exc)
                data = b""
            chat_files = {}
            for name in CHAT_TEMPLATE_FILES:
                with contextlib.suppress(OSError):  # (absent: most models lack one or two)
                    chat_files[name] = (directory / name).read_bytes()
            self._tokenizer_file = data, chat_files
        return self._tokenizer_file


class OutputDoor:
    """Greetings and deltas to clients, for an output processor (see the module doc)."""

    def __init__(
        self, edge: Edge, processor, config: EngineConfig, restarted: bool = False
    ) -> None:
        self.edge = edge
        self.processor = processor
        self.hello = encoder.encode(Hello(config.engine_id))
        self.decoder = msgspec.msgpack.Decoder(Hello)
        self.backlog: dict[str, list[OutputDelta]] = {}  # clients that stopped reading
        # A restarted output processor: its predecessor's clients are still connecting
        # again; until then one not (yet) there keeps its deltas instead of being gone.
        self.returning_until = time.monotonic() + CLIENTS_RETURN_S if restarted else 0.0

    def greet(self) -> None:
        """Answer every greeting waiting now (clients send nothing else to this edge)."""
        for client_id, frame in self.edge.receive(0.0):
            try:
                refused = check_hello(self.decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                refused = f"expected a Hello: {exc}"
            reply = encoder.encode(RequestError("", refused)) if refused else self.hello
            if not refused:  # (a connection under the id of one found gone: a new client)
                self.processor.client_back(client_id.decode(errors="replace"))
            self.edge.send(client_id, reply)

    def send(self, deltas: list[tuple[str, OutputDelta]]) -> None:
        """Send each client its deltas of this step in one message."""
        batches: dict[str, list[OutputDelta]] = defaultdict(list)
        for client_id, delta in deltas:
            batches[client_id].append(delta)
        if self.backlog:
            self._flush_backlog(batches)
        for client_id, sent in self.edge.send_outputs(batches).items():
            if sent is Sent.GONE and self._returning(client_id, batches[client_id]):
                continue
            if sent is Sent.GONE:
                if self.processor.drop_client(client_id):
                    logger.info("client %s is gone: aborting its requests", client_id)
                continue
            logger.warning(
                "client %s does not read its outputs (%d messages queued): aborting its requests",
                client_id,
                self.edge.send_hwm,
            )
            self._abort(client_id, batches[client_id])

    def _flush_backlog(self, batches: dict[str, list[OutputDelta]]) -> None:
        """Retry the clients that stopped reading; their new deltas wait behind the backlog
        (and, since their requests were aborted, these are final deltas of newer ones)."""
        for client_id in list(self.backlog):
            pending = self.backlog[client_id] + batches.pop(client_id, [])
            sent = self.edge.send(client_id.encode(), encoder.encode(OutputBatch(pending)))
            if sent is Sent.OK:
                del self.backlog[client_id]
            elif sent is Sent.GONE:
                if not self._returning(client_id, pending):
                    del self.backlog[client_id]
                    self.processor.drop_client(client_id)
            else:  # still not reading: whatever it asked for since is aborted as well
                self._abort(client_id, pending)

    def _returning(self, client_id: str, pending: list[OutputDelta]) -> bool:
        """Whether a client found gone may still be connecting again to this restarted
        output processor: then its deltas wait in the backlog."""
        if time.monotonic() >= self.returning_until:
            return False
        self.backlog[client_id] = pending
        return True

    def _abort(self, client_id: str, unsent: list[OutputDelta]) -> None:
        """Abort the client's requests; keep what it did not get, only final deltas are kept
        if the backlog grows past a bound (a client that asks but never reads)."""
        message = "aborted: the client did not read its outputs (client_send_hwm reached)"
        pending = unsent + [delta for _, delta in self.processor.abort_client(client_id, message)]
        if len(pending) > 4 * self.edge.send_hwm:
            pending = [delta for delta in pending if delta.finish_reason is not None]
        self.backlog[client_id] = pending
