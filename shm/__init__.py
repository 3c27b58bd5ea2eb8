"""POSIX shared-memory transport between the engine's processes (no torch, no mpengine).

- :class:`Segment`: a named segment, mode 0600, unlinked by its creator; :func:`sweep_stale`.
- :class:`Ring`: single-producer single-consumer ring of variable-length frames.
- :class:`Broadcast`: one writer, N readers, each of whom reads every frame.
- :class:`Lockstep`: a monotonic u64 counter with one writer and sleeping readers.
- ``shm.reaper``: a small process that removes a dead owner's objects and files.
"""

from shm.broadcast import Broadcast, PeerGone
from shm.lockstep import Lockstep
from shm.ring import Ring
from shm.segment import Segment, ShmSpaceError, make_name, owner_pid, sweep_stale

__all__ = [
    "Broadcast",
    "Lockstep",
    "PeerGone",
    "Ring",
    "Segment",
    "ShmSpaceError",
    "make_name",
    "owner_pid",
    "sweep_stale",
]
