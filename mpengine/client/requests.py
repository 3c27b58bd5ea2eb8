"""Waiting for the engine: one request state machine, and the steps (``waits``) of each
wait, written once for both clients.

``Request`` is one submitted request seen from its caller: its deltas assembled, and two
states, ``ended`` (every final delta, or the error, has reached this side: nothing more
will come) and ``finished`` (the caller has read its final delta).

A batch call's requests go in a ``Window`` of the engine's bounds (``Batch.steps``); a
query waits for its one reply (``query_steps``). Steps that stop early, by an error, a
timeout or a cancellation, forget their requests and abort those still running in one
chunked ``Abort`` (``cancel``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

from mpengine.client.connection import Connection, Sink
from mpengine.client.outputs import Assembly, EmbeddingOutput, RequestOutput
from mpengine.client.replicas import Replicas
from mpengine.client.sockets import Deadline
from mpengine.client.waits import AsyncInbox, Inbox, Steps
from mpengine.protocol import AddRequest, EngineInfo, OutputDelta

Mailbox = Inbox | AsyncInbox


class Request:
    """One submitted request seen from its caller (see the module's docstring); its events
    go to ``put`` as ``(request, delta or exception)``. ``index``: its place in its call."""

    def __init__(
        self,
        conn: Connection | Replicas,
        request: AddRequest,
        put: Sink,
        index: int = 0,
        rank: int | None = None,
    ) -> None:
        # The connection of the replica that runs it (pinned by ``rank``, or routed).
        self.conn = conn = conn.route(request, rank)
        self.request_id = request.request_id
        self.index = index
        self.assembly = Assembly(request)
        self.assembly.output.metrics.data_parallel_rank = conn.index
        # Final deltas (or the error) not yet received by the I/O thread.
        self._finals_due = self.assembly.num_open

        def receive(item: OutputDelta | BaseException) -> None:
            if isinstance(item, BaseException):
                self._finals_due = 0
            elif item.finish_reason is not None:
                self._finals_due -= 1
            put((self, item))

        self.wire_id = conn.submit(request, receive)

    @property
    def ended(self) -> bool:
        """Nothing more will come for it: it has ended on the engine (or failed), and a
        late reader still gets what is left."""
        return self._finals_due <= 0

    @property
    def finished(self) -> bool:
        """The caller has read its final delta."""
        return self.assembly.output.finished

    def expect(self, deadline: Deadline) -> str:
        """What its reader waits for next, as a timeout names it; that timeout now if the
        deadline has passed while it still runs (a reader slower than the engine always
        finds a delta waiting; those of a request that ended are the reader's, late or not)."""
        what = f"request {self.request_id!r} aborted: not finished"
        if deadline.passed and not self.ended:
            raise deadline.error(what)
        return what

    def output(self) -> RequestOutput:
        """What it has returned so far, assembled: the finished request's result."""
        return self.assembly.output

    def embedding(self) -> EmbeddingOutput:
        """The finished pooling request's result, or ``RequestFailedError``."""
        return self.assembly.embedding_output()

    def take(self, item: OutputDelta | BaseException) -> RequestOutput | None:
        """Read one delta (the error that ended the request raises); None when it holds
        nothing new."""
        if isinstance(item, BaseException):
            self.conn.forget(self.request_id, self.wire_id)
            raise item
        delta = self.assembly.add(item)
        if delta is not None and delta.finished:
            self.conn.forget(self.request_id, self.wire_id)
        return delta


def cancel(requests: Sequence[Request]) -> None:
    """Their caller stopped waiting: forget the requests (their ids are free again), abort
    those still running, in one chunked ``Abort``."""
    running: dict[int, list[Request]] = {}  # by connection (replica)
    for request in requests:
        request.conn.forget(request.request_id, request.wire_id)
        if not request.ended:
            running.setdefault(id(request.conn), []).append(request)
    for chunk in running.values():
        chunk[0].conn.abort([r.wire_id for r in chunk])


class Window:
    """The requests of one batch call in flight at once. The engine refuses a request
    (``overloaded``) once ``max_waiting_requests`` sequences (one per sample or beam) or
    ``max_waiting_tokens`` prompt tokens wait for admission, of which one tenant may take
    half; a batch keeps at most a quarter of its tenant's half of the tokens in flight, and
    as many sequences as a step takes (``max_num_seqs``, within a quarter of the queue) or
    an eighth of the queue, whichever is more (four big batch calls of one tenant fit its
    half of the default queue at once), but no more than four steps take. It submits the
    rest as earlier ones finish, whichever they are (a long one does not hold back the
    others), marked ``continues`` (a draining engine lets the call finish, and the engine
    refuses them only past twice its bounds)."""

    def __init__(self, info: EngineInfo) -> None:
        self.max_seqs = self.max_tokens = 1 << 62  # an engine that does not say
        if info.max_waiting_requests:
            queue, seqs = info.max_waiting_requests, info.max_num_seqs
            # A step's worth at least (within a quarter of the queue), else an eighth of it.
            self.max_seqs = max(1, min(4 * seqs, max(queue // 8, min(seqs, queue // 4))))
            self.max_tokens = max(1, info.max_waiting_tokens // 8)
        self.inflight: dict[int, tuple[int, int]] = {}  # request in flight -> (seqs, tokens)
        self.seqs = self.tokens = 0
        self.released = 0  # requests that finished and left the window

    @staticmethod
    def size(request: AddRequest) -> tuple[int, int]:
        """The sequences and prompt tokens ``request`` weighs in the engine's queue."""
        seqs = 1 if request.sampling is None else request.sampling.num_samples
        return seqs, len(request.prompt_token_ids)

    def admits(self, request: AddRequest) -> bool:
        """Whether ``request`` may go now; else one in flight must finish first."""
        seqs, tokens = self.size(request)
        fits = self.seqs + seqs <= self.max_seqs and self.tokens + tokens <= self.max_tokens
        return not self.inflight or fits

    def add(self, request: Request, add: AddRequest) -> None:
        seqs, tokens = self.inflight[id(request)] = self.size(add)
        self.seqs += seqs
        self.tokens += tokens

    def release(self, finished: list[Request]) -> None:
        for request in finished:
            size = self.inflight.pop(id(request), None)
            if size is not None:
                self.seqs -= size[0]
                self.tokens -= size[1]
                self.released += 1


# A batch call's request, before it is made: (prompt, parameters, request id, priority).
Job = tuple[Any, Any, str | None, int]


@dataclass(slots=True)
class Batch:
    """A batch call (``generate_many``, ``embed_many``; a lone ``generate`` or ``embed`` is
    a batch of one): ``make(*job)`` makes each job's request, ``result`` is what the call
    returns of each, ``finished`` sees each as it finishes (in finishing order)."""

    make: Callable[..., AddRequest]
    jobs: list[Job]
    result: Callable[[Request], Any]
    finished: Callable[[Request], object] | None = None
    tenant: str = ""  # whose share of the engine its requests use ("": the client's)
    rank: int | None = None  # the data-parallel replica that runs them (None: routed)

    @property
    def prompts(self) -> list[Any]:
        return [job[0] for job in self.jobs]

    def made(self) -> Iterator[AddRequest]:
        """The requests, each made (its text tokenized) as it is asked for."""
        return (self.make(*job) for job in self.jobs)

    def steps(
        self,
        conn: Connection | Replicas,
        made: Iterable[AddRequest],
        inbox: Mailbox,
        deadline: Deadline,
    ) -> Steps[list]:
        """Submit ``made`` within a ``Window`` of the engine's bounds, then wait (in
        ``inbox``, until ``deadline``) for every request to finish; return their results in
        order. The first refused or failed one raises at once, whichever it is; on any error
        the unfinished are aborted."""
        window = Window(conn.info)
        requests: list[Request] = []
        try:
            for add in made:
                while not window.admits(add):  # wait for one in flight to finish
                    window.release((yield from self._take(inbox, deadline, None)))
                add.continues = window.released > 0
                add.tenant = self.tenant
                requests.append(Request(conn, add, inbox.put, len(requests), self.rank))
                window.add(requests[-1], add)
            yield from self._take(inbox, deadline, requests)
            return [self.result(r) for r in requests]
        finally:
            cancel(requests)

    def _take(
        self, inbox: Mailbox, deadline: Deadline, waited: Sequence[Request] | None
    ) -> Steps[list[Request]]:
        """Take the batch's events, in arrival order, until every request of ``waited``
        has finished (None: until any request of the batch has); return those that
        finished meanwhile."""
        left = {id(r) for r in waited or () if not r.finished}
        done: list[Request] = []
        while left if waited is not None else not done:
            what = f"{len(left)} requests" if left else "the batch's requests"
            request, item = yield partial(inbox.get, deadline, f"{what} aborted: not finished")
            request.take(item)
            if request.finished:
                left.discard(id(request))
                done.append(request)
                if self.finished is not None:
                    self.finished(request)
        return done


def query_steps(
    conn: Connection | Replicas,
    make: Callable[[int], msgspec.Struct],
    inbox: Mailbox,
    deadline: Deadline,
    rank: int | None = None,
) -> Steps[Any]:
    """Send ``make(query_id)`` and return the engine's reply (waited for in ``inbox``);
    ``rank``: of that data-parallel replica only."""
    query_id = conn.query(make, inbox.put, rank)
    try:
        reply = yield partial(inbox.get, deadline, f"no reply to {make.__name__}")
    finally:
        conn.queries.pop(query_id, None)
    if isinstance(reply, BaseException):
        raise reply
    return reply
