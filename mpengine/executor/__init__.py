"""The executor stage: model, paged KV cache, sampling, pooling. The only stage that
imports torch."""

from mpengine.executor.executor import Executor
from mpengine.executor.faults import create_executor

__all__ = ["Executor", "create_executor"]
