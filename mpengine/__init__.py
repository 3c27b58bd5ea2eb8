"""mpengine: an LLM engine core whose scheduler, executor and output processor run as three
OS processes, in lockstep over shared-memory rings."""

__version__ = "0.1.0"

from mpengine.client import (
    AsyncClient,
    Client,
    CompletionOutput,
    EmbeddingOutput,
    RequestMetrics,
    RequestOutput,
)
from mpengine.config import EngineConfig
from mpengine.errors import (
    ClientClosedError,
    EngineDeadError,
    EngineStartError,
    InvalidRequestError,
    ProtocolError,
    RequestFailedError,
)
from mpengine.launch import Engine, launch
from mpengine.protocol import (
    EngineInfo,
    EngineStats,
    PoolingParams,
    SamplingParams,
    StructuredOutputs,
)

__all__ = [
    "AsyncClient",
    "Client",
    "ClientClosedError",
    "CompletionOutput",
    "EmbeddingOutput",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "EngineStartError",
    "EngineStats",
    "InvalidRequestError",
    "PoolingParams",
    "ProtocolError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "__version__",
    "launch",
]
