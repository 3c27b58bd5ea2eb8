"""Who goes first and who gives way: the batching policy's choices, pure functions of the
scheduler's lists (``running`` in admission order, ``preempted`` most recent first), of
``scheduling_policy`` (``by_priority``: lower priority numbers first, else first come,
first served) and of the sequences each tenant runs (``counts``, see ``waiting.py``):
among equals, the tenant running fewer goes first and the one running more gives way."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mpengine.scheduler.beams import waiting_beam
from mpengine.scheduler.request import Request, Sequence, Tenant, urgency

Counts = Mapping[Tenant, int]


def choose_victim(
    running: list[Sequence], seq: Sequence, by_priority: bool, counts: Counts
) -> Sequence:
    """Who gives way to running ``seq``: by priority, the least urgent running sequence
    that holds blocks (preempting one without blocks frees nothing), if it is less urgent
    than ``seq``; else the most recently admitted one after ``seq`` that holds blocks, or
    before it, one of a tenant running more than ``seq``'s: of those, one of the tenant
    running the most; else a beam that holds blocks while it waits for its beam step and
    may give way (``waiting_beam``), else ``seq`` itself."""
    if by_priority:
        holders = [s for s in running if s.block_ids and s is not seq]
        least = max(holders, key=urgency, default=None)
        if least is not None and urgency(least) > urgency(seq):
            return least
    else:
        own = counts.get(seq.request.tenant, 0)
        after = False
        best: tuple[int, int] | None = None
        victim: Sequence | None = None
        for index, other in enumerate(running):
            if other is seq:
                after = True
                continue
            load = counts.get(other.request.tenant, 0)
            if other.block_ids and (after or load > own) and (best is None or (load, index) > best):
                best, victim = (load, index), other
        if victim is not None:
            return victim
    return waiting_beam(running, seq) or seq


def fair_victim(
    running: list[Sequence], tenant: Tenant, want: int, priority: int, counts: Counts
) -> Sequence | None:
    """A sequence to preempt so that ``tenant``, waiting to run ``want`` more sequences
    of ``priority``, gets its share: the most recently admitted one holding blocks of the
    tenant running the most, if that one still runs as many as ``tenant`` afterwards and
    is no more urgent; else None (``tenant`` waits its turn)."""
    others = [(count, t) for t, count in counts.items() if t != tenant]
    if not others:
        return None
    count, top = max(others)
    if count - 1 < counts.get(tenant, 0) + want:
        return None
    for seq in reversed(running):
        request = seq.request
        if request.tenant == top and seq.block_ids and request.priority >= priority:
            return seq
    return None


def resume_first(preempted: Iterable[Sequence], waiting: Request | None, counts: Counts) -> bool:
    """Whether a preempted sequence has the next turn before the waiting request whose turn
    it is: it goes back among the waiting requests, before those of its own priority whose
    tenant runs as many or more (under first come, first served, all priorities are 0; with
    one tenant, it goes before them all)."""
    turns = [turn(seq.request, counts) for seq in preempted]
    return bool(turns) and (waiting is None or min(turns) <= turn(waiting, counts))


def next_to_resume(
    preempted: Iterable[Sequence], by_priority: bool, counts: Counts
) -> Sequence | None:
    """The preempted sequence to resume next: of the tenant running the fewest (by
    priority, the most urgent first, then that), the most urgent by priority, else the one
    preempted last (victims come from the running list's end: the earliest admitted of
    them); only among those with no token in flight (a recompute needs every token id: one
    waits for its in-flight tokens, without holding up the others)."""
    ready = [
        (*turn(seq.request, counts), urgency(seq) if by_priority else (index,), seq)
        for index, seq in enumerate(preempted)
        if not seq.num_inflight
    ]
    return min(ready, key=lambda entry: entry[:3])[3] if ready else None


def turn(request: Request, counts: Counts) -> tuple[int, int]:
    """Whose turn comes first (lower): by priority, then the tenant running fewer."""
    return request.priority, counts.get(request.tenant, 0)
