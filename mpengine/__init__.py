"""mpengine: an LLM engine core whose scheduler, executor and output processor run as three
OS processes, in lockstep over shared-memory rings."""

__version__ = "0.1.0"

from mpengine.client import (  # noqa: E402
    AsyncClient,
    Client,
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
)
from mpengine.config import EngineConfig  # noqa: E402
from mpengine.launch import Engine, EngineDeadError, EngineStartError, launch  # noqa: E402
from mpengine.protocol import PoolingParams, SamplingParams  # noqa: E402

__all__ = [
    "AsyncClient",
    "Client",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineStartError",
    "InvalidRequestError",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "launch",
]
