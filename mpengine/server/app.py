"""The FastAPI application: routes, API key, body limit, health and metrics.

    POST /v1/completions          completions.py
    POST /v1/chat/completions     chat.py
    POST /v1/embeddings           embeddings.py
    GET  /v1/models[/NAME]        the served model names, or one of them
    GET  /version                 the engine's version
    GET  /health                  200 when serving; 503 dead, draining or stalled (health.py)
    GET  /metrics                 Prometheus text (metrics.py)
    POST /tokenize, /detokenize   vLLM's, with the engine's tokenizer and chat template

CORS headers (``--allowed-origins``...) default to vLLM's: any origin. Only ``/v1/*`` needs
the API key (``Authorization: Bearer KEY``), as in vLLM: health and metrics serve probes
and scrapers. A model that cannot generate (an encoder such as BERT) answers the two
generation endpoints with 400; one that cannot pool answers embeddings so.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mpengine import __version__
from mpengine.metrics import CONTENT_TYPE
from mpengine.server.chat import chat_prompt, create_chat_completion, tokenize_chat
from mpengine.server.completions import create_completion
from mpengine.server.embeddings import create_embedding
from mpengine.server.errors import APIError, install_handlers
from mpengine.server.request_logs import AccessLog
from mpengine.server.schemas import (
    CHAT_TEMPLATE_REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from mpengine.server.state import ServerState


@dataclass(frozen=True, slots=True)
class Cors:
    """Which other origins' pages may call the API (``--allowed-origins``...)."""

    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool = False


def _json(value: msgspec.Struct | dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


def build_app(state: ServerState, cors: Cors | None = None) -> FastAPI:
    # /docs and /openapi.json as FastAPI makes them, from the request schemas.
    app = FastAPI(title="mpengine", version=__version__, redoc_url=None)
    app.state.server = state
    install_handlers(app)
    app.add_middleware(BodyLimit, limit=state.max_body_bytes, timeout=state.body_timeout_s)
    if state.api_key is not None:  # before the body is read: 401 whatever it holds
        app.add_middleware(ApiKey, key=state.api_key)
    if cors is not None:  # a preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.origins,
            allow_methods=cors.methods,
            allow_headers=cors.headers,
            allow_credentials=cors.credentials,
        )
    app.add_middleware(CountResponses, state=state)  # every answer counts
    if state.access_log:  # outermost: a line once the answer is complete
        app.add_middleware(AccessLog)
    app.include_router(_v1_routes(state))
    app.include_router(_service_routes(state))
    return app


def _v1_routes(state: ServerState) -> APIRouter:
    """The OpenAI API: completions, chat completions, embeddings, models; and SageMaker's
    ``/invocations``, which takes any of the three."""

    def check_generates(name: str | None) -> None:
        """400 for a generation request to a model that only embeds."""
        if not state.info.can_generate:
            model = state.check_model(name)
            message = (
                f"the model {model!r} cannot generate: it is an embedding model "
                "(use /v1/embeddings)"
            )
            raise APIError(400, message, "model")

    v1 = APIRouter()

    @v1.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_generates(body.model)
        return await create_completion(state, body, request)

    @v1.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_generates(body.model)
        return await create_chat_completion(state, body, request)

    @v1.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(state, body, request)

    def card(name: str) -> ModelCard:
        return ModelCard(name, state.created, state.info.model, state.info.max_model_len)

    @v1.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList([card(name) for name in state.model_names]))

    @v1.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        """One model's card (``client.models.retrieve``); 404 for a name not served."""
        return _json(card(state.check_model(name)))

    @v1.post("/invocations")
    async def invocations(request: Request) -> Response:
        """The body's shape picks the API, as vLLM's ``/invocations`` does: ``messages``, a
        chat completion; ``prompt``, a completion; ``input``, embeddings."""
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise APIError(400, f"the body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        for field, schema, handler in (
            ("messages", ChatCompletionRequest, chat_completions),
            ("prompt", CompletionRequest, completions),
            ("input", EmbeddingRequest, embeddings),
        ):
            if field in body:
                try:
                    parsed = schema.model_validate(body)
                except ValidationError as exc:
                    raise RequestValidationError(exc.errors()) from None
                return await handler(parsed, request)  # type: ignore[operator]
        raise APIError(400, "give messages (chat), prompt (completion) or input (embeddings)")

    return v1


def _service_routes(state: ServerState) -> APIRouter:
    """Version, health, metrics, and tokenization as vLLM serves them."""
    router = APIRouter()

    @router.get("/version")
    async def version() -> Response:
        return _json({"version": __version__})

    @router.api_route("/ping", methods=["GET", "POST"])  # (SageMaker's health check)
    @router.get("/health")
    async def health() -> Response:
        problem = state.monitor.problem()
        if problem is not None:
            raise APIError(503, problem, code="unhealthy")
        if state.monitor.size == 1:
            return Response(b'{"status":"ok"}', media_type="application/json")
        # Serving while one replica does; which ones do not, and why.
        replicas = [
            {"engine": str(i), "status": "ok" if p is None else "unhealthy", "problem": p}
            for i, p in enumerate(state.monitor.replica_problems())
        ]
        status = "ok" if all(r["problem"] is None for r in replicas) else "degraded"
        return _json({"status": status, "replicas": replicas})

    @router.get("/metrics")
    async def metrics() -> Response:
        await state.monitor.poll()  # the engine's numbers as of now
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.tools is not None and body.messages is None:
            raise APIError(400, "tools are rendered with messages: give messages", "tools")
        if body.chat_template is not None:
            raise APIError(400, CHAT_TEMPLATE_REFUSED, "chat_template")
        if body.messages is not None:
            if not body.messages:  # as chat completions refuse it
                raise APIError(400, "messages is empty: give at least one message", "messages")
            ids = await chat_prompt(state, tokenize_chat(body))
        else:
            (ids,) = await state.text.encode([body.prompt or ""], body.add_special_tokens)
        strs = state.text.token_strs(ids) if body.return_token_strs else None
        return _json(TokenizeResponse(len(ids), state.info.max_model_len, ids, strs))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        state.check_model(body.model)
        vocab, most = state.info.vocab_size, state.info.max_model_len
        if len(body.tokens) > most:  # (no sequence of the model is longer)
            raise APIError(400, f"tokens: at most max_model_len ({most}) ids", "tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in 0..{vocab - 1}", "tokens")
        return _json(DetokenizeResponse(state.text.decode(body.tokens)))

    return router


# Besides /v1/...: the other routes that make the server work for the client (health,
# version and metrics stay open, for probes and scrapers).
GUARDED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", "/invocations"})


class ApiKey:
    """``Authorization: Bearer KEY`` on every ``/v1`` path, ``/invocations``, ``/tokenize``
    and ``/detokenize`` (vLLM leaves those two open, but a large chat to render there is work
    for anyone),
    compared in constant time and checked before anything else of the request: a body that
    is too large or not JSON is a 401 too, as in vLLM."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path in GUARDED_PATHS):
            authorization = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = authorization.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key, self.expected):
                message = "a valid API key is required (Authorization: Bearer KEY)"
                error = APIError(401, message, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountResponses:
    """``http_requests_total{handler, method, status}`` as vLLM's instrumentator counts them
    (status as ``2xx``...; a path the server does not serve counts as ``none``): refused
    requests (400, 401, 413, 503) show in no other metric."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.counter = state.metrics.http_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        handler = path if path in ROUTES else "none"
        if path.startswith("/v1/models/"):
            handler = "/v1/models/{name}"
        method = scope.get("method", "")
        method = method if method in METHODS else "other"  # (any token is a method to h11)
        started = False

        async def counting(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(handler, method, f"{message['status'] // 100}xx").inc()
            await send(message)

        try:
            await self.app(scope, receive, counting)
        except Exception:
            if not started:  # answered 500 by the server's error handler, outside this one
                self.counter.labels(handler, method, "5xx").inc()
            raise


METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/models",
        "/health",
        "/version",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/ping",
        "/invocations",
        "/docs",
        "/openapi.json",
    }
)


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, before reading it when its
    Content-Length says so, else as soon as the bytes read pass the limit; and one that
    takes over ``timeout`` seconds to arrive with 408 (a client sending a byte now and then
    held its connection, and its parse, for as long as it liked)."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float = 60.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0
        deadline: float | None = None  # from the first read of the body
        body_done = False

        async def counted() -> Message:
            nonlocal received, deadline, body_done
            if body_done:  # (a disconnect listener: no deadline)
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise HTTPException(
                    408, f"the request body took over {self.timeout:g} s to arrive"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.limit:
                    error = self._too_large()
                    raise HTTPException(413, error.message)
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body exceeds {self.limit} bytes", code="request_too_large"
        )
