"""The executor stage: model, paged KV cache, sampling, pooling. The only stage that
imports torch."""

from mpengine.executor.executor import Executor

__all__ = ["Executor"]
