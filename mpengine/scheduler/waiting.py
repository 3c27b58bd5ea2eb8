"""Requests waiting for admission, and whose turn it is: tenants take turns.

A tenant is a client, or a share a client names (``AddRequest.tenant``: the HTTP server
names each HTTP request, or its ``user``, so that one batch of 4,000 prompts with ``n=64``
is one tenant, not the whole server). The next request is the first one of the tenant
that runs the fewest sequences (with the priority policy, the most urgent first, then
that), ties going to the earliest; a tenant's own requests keep their order (priority,
then arrival). With one tenant this is first come, first served (or by priority) as
before; with many, a small request of a tenant running nothing goes before the next of a
tenant running hundreds. The scheduler also preempts a tenant over its share for one
waiting under it (``policy.fair_victim``).

Tenants that run nothing wait in a heap by their first request (a burst of thousands of
one-request tenants costs a heap operation each); those that run some, at most
``max_num_seqs`` of them, are compared one by one. Aborted requests stay until they reach
their tenant's head (``first`` drops them there, no O(n) removal) but count no more.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from mpengine.scheduler.request import Request, Tenant

# (priority, key, request): a heap entry, in admission order (keys count arrivals).
_Entry = tuple[int, int, Request]


class WaitingQueue:
    """The waiting requests per tenant, what they weigh (``num_requests``, ``num_seqs``:
    one per sample or beam, ``num_tokens``: prompt tokens; per tenant ``load``), and the
    sequences each tenant runs (``running``, kept by the scheduler through ``seat`` and
    ``unseat``)."""

    def __init__(self) -> None:
        self._queues: dict[Tenant, list[_Entry]] = {}
        self._idle: list[tuple[int, int, Tenant]] = []  # heads of tenants running nothing
        self.running: dict[Tenant, int] = {}  # tenants running sequences: how many
        self._loads: dict[Tenant, list[int]] = {}  # tenant -> [sequences, prompt tokens]
        self.num_requests = self.num_seqs = self.num_tokens = 0

    def append(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._queues.setdefault(tenant, [])
        heapq.heappush(queue, (request.priority, request.key, request))
        if queue[0][2] is request and tenant not in self.running:
            heapq.heappush(self._idle, (request.priority, request.key, tenant))
        self._count(request, 1)

    def first(self) -> Request | None:
        """The request whose turn it is (dropping those aborted meanwhile), or None."""
        if not self._queues:  # (the scheduler asks every step)
            return None
        best: tuple[int, int, int, Request] | None = None
        while self._idle:
            priority, key, tenant = self._idle[0]
            head = self._head(tenant)
            if head is not None and head.key == key and tenant not in self.running:
                best = (priority, 0, key, head)
                break
            heapq.heappop(self._idle)  # stale: admitted, aborted or running since
            if head is not None and head.key != key and tenant not in self.running:
                heapq.heappush(self._idle, (head.priority, head.key, tenant))
        # Tenants that run sequences and wait: walk the fewer of the two.
        fewer = self._queues if len(self._queues) < len(self.running) else self.running
        for tenant in list(fewer):
            count = self.running.get(tenant, 0)
            if count and tenant in self._queues and (head := self._head(tenant)) is not None:
                turn = (head.priority, count, head.key, head)
                if best is None or turn[:3] < best[:3]:
                    best = turn
        return None if best is None else best[3]

    def admit(self, request: Request) -> None:
        """Take ``request``, the one ``first`` returned, out of the queue."""
        queue = self._queues[request.tenant]
        assert queue[0][2] is request and not request.finished
        heapq.heappop(queue)
        if not queue:
            del self._queues[request.tenant]
        self.forget(request)

    def forget(self, request: Request) -> None:
        """``request`` leaves: admitted, or finished while it waits (it stays in its
        tenant's queue until it reaches the head, but counts no more)."""
        self._count(request, -1)

    def load(self, tenant: Tenant) -> tuple[int, int]:
        """The sequences and prompt tokens ``tenant`` has waiting."""
        seqs, tokens = self._loads.get(tenant, (0, 0))
        return seqs, tokens

    def seat(self, tenant: Tenant, num_seqs: int = 1) -> None:
        """``num_seqs`` sequences of ``tenant`` started running (admitted, resumed)."""
        self.running[tenant] = self.running.get(tenant, 0) + num_seqs

    def unseat(self, tenant: Tenant) -> None:
        """A sequence of ``tenant`` stopped running (preempted, finished)."""
        count = self.running[tenant] - 1
        if count:
            self.running[tenant] = count
            return
        del self.running[tenant]
        if (head := self._head(tenant)) is not None:
            heapq.heappush(self._idle, (head.priority, head.key, tenant))

    def _head(self, tenant: Tenant) -> Request | None:
        """``tenant``'s first request still waiting (dropping aborted ones), or None."""
        queue = self._queues.get(tenant)
        while queue and queue[0][2].finished:
            heapq.heappop(queue)
        if queue:
            return queue[0][2]
        self._queues.pop(tenant, None)
        return None

    def _count(self, request: Request, sign: int) -> None:
        num_seqs, num_tokens = sign * len(request.seqs), sign * request.num_prompt_tokens
        self.num_requests += sign
        self.num_seqs += num_seqs
        self.num_tokens += num_tokens
        load = self._loads.setdefault(request.tenant, [0, 0])
        load[0] += num_seqs
        load[1] += num_tokens
        if not load[0]:
            del self._loads[request.tenant]

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))

    def __iter__(self) -> Iterator[Request]:
        """Every queued request, each tenant's in its order, the tenants in turn order as
        of now (for stats and tests; aborted ones included until they reach a head)."""
        entries = sorted(
            (entry[0], self.running.get(tenant, 0), entry[1], entry[2])
            for tenant, queue in self._queues.items()
            for entry in queue
        )
        return (entry[3] for entry in entries)
