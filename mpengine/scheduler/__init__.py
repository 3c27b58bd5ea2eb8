"""The scheduler stage: requests, queues, KV blocks, batching policy (pure Python)."""

from mpengine.scheduler.admission import RequestRejected
from mpengine.scheduler.block_manager import BlockManager
from mpengine.scheduler.request import Request, Sequence, Status
from mpengine.scheduler.scheduler import Scheduler

__all__ = ["BlockManager", "Request", "RequestRejected", "Scheduler", "Sequence", "Status"]
