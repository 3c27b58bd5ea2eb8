"""Spin, then sleep on a POSIX semaphore: the wait shared by the ring and the lockstep counter.

See ``shm.ring`` for the protocol (sleeping flag, post after publish, growing re-check
slices that make a lost wake-up cost one slice at most).
"""

from __future__ import annotations

import ctypes
from time import perf_counter
from typing import Protocol

import posix_ipc

# Spin budget before sleeping. Spinning pays only while the other side has a CPU to answer on.
# Ring ping-pong of 1 KiB frames on the 2-core VM (tools/bench_ipc.py; medians of hops):
# - a core free for each side: a spin of 20 us or more caught nearly every hop (3.3 us);
#   sleeping every time cost 25 us (the futex wake-up and the switch across cores);
# - oversubscribed (other jobs kept the load average at 4-6): sleeping 9-11 us, spinning
#   50 us 61 us (the spinner held the CPU its peer needed), spinning with sched_yield 5 us,
#   but 2 ms beside two CPU hogs (a yield hands a hog a whole time slice).
# Hence no yield, and a budget that adapts: a wait that ends within the spin restores the full
# budget, one that has to sleep halves it, down to an eighth (6 us, still above a fast hop).
# Oversubscribed, the adaptive 50 us measured 16-19 us; with free cores it stays at 50 us.
SPIN_S = 50e-6
# How long a sleeper waits before its first re-check, and the most its later slices grow
# to: they bound the cost of a lost wake-up (small while waits are short, as in a busy
# pipeline) and the idle cost of re-checking (about 30 wake-ups a second at most).
WAIT_SLICE_S = 0.002
MAX_WAIT_SLICE_S = 0.032


class Waiter(Protocol):
    """What a wait reads and adapts: the spin budget and the counters of slow waits."""

    spin_s: float
    spin_budget_s: float
    num_sleeps: int
    num_missed_wakeups: int


def wait_until(
    cursor: ctypes.c_uint64,
    target: int,
    flag: ctypes.c_uint64,
    sem: posix_ipc.Semaphore,
    waiter: Waiter,
    deadline: float,
) -> int:
    """Spin, then sleep, until ``cursor >= target``; return the cursor, or -1 at ``deadline``.

    The spin adapts (see ``SPIN_S``): a wait that ends within the spin restores the full
    budget ``waiter.spin_s``, one that has to sleep halves it, down to an eighth.
    """
    now = perf_counter()
    budget = waiter.spin_budget_s
    spin_end = min(now + budget, deadline)
    while True:
        value = cursor.value
        if value >= target:
            waiter.spin_budget_s = waiter.spin_s
            return value
        if now >= spin_end:
            break
        now = perf_counter()
    if now >= deadline:
        return -1
    waiter.spin_budget_s = max(budget * 0.5, waiter.spin_s * 0.125)
    flag.value = 1  # from here the other side posts after each publish
    slice_s = WAIT_SLICE_S
    try:
        while True:
            value = cursor.value
            if value >= target:
                return value
            remaining = deadline - perf_counter()
            if remaining <= 0:
                return -1
            waiter.num_sleeps += 1
            try:
                sem.acquire(min(remaining, slice_s))
            except posix_ipc.BusyError:
                if cursor.value >= target:
                    waiter.num_missed_wakeups += 1
                slice_s = min(slice_s * 2, MAX_WAIT_SLICE_S)
            except posix_ipc.SignalError:
                pass  # as PEP 475: the handler has run; re-check, then wait on
    finally:
        flag.value = 0
