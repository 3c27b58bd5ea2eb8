"""Who goes first and who gives way: the batching policy's choices, pure functions of the
scheduler's lists (``running`` in admission order, ``preempted`` most recent first) and of
``scheduling_policy`` (``by_priority``: lower priority numbers first, else first come,
first served)."""

from __future__ import annotations

from collections.abc import Iterable

from mpengine.scheduler.beams import waiting_beam
from mpengine.scheduler.request import Request, Sequence, urgency


def choose_victim(running: list[Sequence], seq: Sequence, by_priority: bool) -> Sequence:
    """Who gives way to running ``seq``: the most recently admitted running sequence after
    it that holds blocks (preempting one without blocks frees nothing); by priority, the
    least urgent one that holds blocks, if it is less urgent than ``seq``; else a beam that
    holds blocks while it waits for its beam step and may give way (``waiting_beam``),
    else ``seq`` itself."""
    if by_priority:
        holders = [s for s in running if s.block_ids and s is not seq]
        least = max(holders, key=urgency, default=None)
        if least is not None and urgency(least) > urgency(seq):
            return least
    else:
        for victim in reversed(running):
            if victim is seq:
                break
            if victim.block_ids:
                return victim
    return waiting_beam(running, seq) or seq


def resume_first(preempted: Iterable[Sequence], waiting: Request | None) -> bool:
    """Whether a preempted sequence has the next turn before the first waiting request: it
    goes back among the waiting requests, before those of its own priority (under first
    come, first served, all priorities are 0: before them all)."""
    priorities = [seq.request.priority for seq in preempted]
    return bool(priorities) and (waiting is None or min(priorities) <= waiting.priority)


def next_to_resume(preempted: Iterable[Sequence], by_priority: bool) -> Sequence | None:
    """The preempted sequence to resume next: the most urgent by priority, else the one
    preempted last (victims come from the running list's end: the earliest admitted of
    them); only among those with no token in flight (a recompute needs every token id:
    one waits for its in-flight tokens, without holding up the others)."""
    ready = [seq for seq in preempted if not seq.num_inflight]
    if not ready:
        return None
    return min(ready, key=urgency) if by_priority else ready[0]
