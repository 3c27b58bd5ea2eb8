"""The IPC client library: connect to a running engine, sync or asyncio.

    with mpengine.launch(model="tiny") as engine:
        client = engine.client()
        out = client.generate("Hello", SamplingParams(max_tokens=16, temperature=0))
        print(out.text)

    with mpengine.launch(model="smollm2-135m") as engine:   # through the chat template
        reply = engine.client().chat([{"role": "user", "content": "Hi"}])

    with mpengine.launch(model="tiny-bert") as engine:      # an embedding model
        vectors = [o.embedding for o in engine.client().embed_many(["a", "b"])]

    client = mpengine.Client("tcp://gpu-box:5555", auth_token="...")   # a running engine

The modules, bottom up: ``sockets`` (a DEALER socket to one engine edge and its
handshake), ``connection`` (both sockets, the one I/O thread that owns them, wire ids,
abort frames), ``outputs`` (what calls return, assembled from deltas), ``tokens`` (token
ids, the engine's tokenizer and chat template), ``waits`` (how a call written as steps is
waited for: blocking or awaiting), ``requests`` (the request state machine, a batch's
window, the steps of each wait), ``base`` (building and checking requests), ``calls``
(every call, written once for both clients), ``sync_client`` (``Client``) and
``async_client`` (``AsyncClient``): facades that only choose how to wait.
"""

from mpengine.client.async_client import AsyncClient
from mpengine.client.outputs import CompletionOutput, EmbeddingOutput, RequestMetrics, RequestOutput
from mpengine.client.sync_client import Client

__all__ = [
    "AsyncClient",
    "Client",
    "CompletionOutput",
    "EmbeddingOutput",
    "RequestMetrics",
    "RequestOutput",
]
