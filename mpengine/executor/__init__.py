"""The executor stage: model, paged KV cache, sampling. The only stage that imports torch."""

from mpengine.executor.executor import Executor
from mpengine.protocol import ExecutorInfo

__all__ = ["Executor", "ExecutorInfo"]
