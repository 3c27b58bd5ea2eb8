"""Errors in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, with
the status a client can act on: 400 bad parameters (naming the field), 401 bad or missing
API key, 404 unknown model or route, 413 too large, 503 overloaded, draining or engine gone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from mpengine.errors import ClientClosedError, EngineDeadError, InvalidRequestError
from mpengine.server.schemas import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# The engine's RequestError kinds.
RETRY_AFTER_S = 1  # what a 503 says to wait before trying again
_KIND_STATUS = {"invalid": 400, "unknown": 400, "too_large": 413, "overloaded": 503}
# Where an error message names the field: msgspec's "... - at `$.temperature`" (the
# engine's own says "- at `sampling.temperature`" or "- at `pooling.dimensions`"), or a
# message that starts with the field, "min_tokens (5) > ...", "pooling.dimensions (65) ...",
# "temperature must ..." or "prompt_token_ids: ..."; a dict's bad key names the dict.
_AT_FIELD = re.compile(r"- at `(?:key` in `)?(?:\$\.)?(?:sampling\.|pooling\.)?([A-Za-z_]\w*)")
_LEADING = re.compile(r"^(?:(?:sampling|pooling)\.([a-z_]+)\b|([a-z_]+)(?::| \(| must\b))")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> Response:
        body = ErrorResponse(
            ErrorInfo(self.message, error_type(self.status), self.param, self.code)
        )
        headers = None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status == 503:  # overloaded, draining or restarting: come back (elsewhere)
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return Response(
            msgspec.json.encode(body),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return _TYPES.get(status, "server_error")


def field_of(message: str) -> str | None:
    """The request field an error message names, if any."""
    if match := _AT_FIELD.search(message):
        return match.group(1)
    if match := _LEADING.match(message):
        return match.group(1) or match.group(2)
    return None


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param if param is not None else field_of(message))


def invalid_value(exc: Exception, names: dict[str, str] | None = None) -> APIError:
    """A ``msgspec.ValidationError`` or ``ValueError`` from building ``SamplingParams``;
    ``names`` maps the engine's fields to the request's where they differ (chat's
    ``top_logprobs`` is the engine's ``logprobs``), so the message names what was sent."""
    message = str(exc)
    for engine_name, name in (names or {}).items():
        message = re.sub(rf"(`\$\.|^){engine_name}\b", rf"\g<1>{name}", message)
    return bad_request(message)


def from_engine(exc: BaseException) -> APIError:
    """What a failed engine request means for the HTTP client."""
    match exc:
        case InvalidRequestError():
            status = _KIND_STATUS.get(exc.kind, 500)
            code = exc.kind if status != 400 else None
            return APIError(status, str(exc), field_of(str(exc)) if status == 400 else None, code)
        case EngineDeadError() | ClientClosedError():
            return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
        case TimeoutError():
            return APIError(503, f"the engine did not answer in time: {exc}", code="timeout")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's JSON, FastAPI's own ones included."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(_location(errors)) or None
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "json_invalid":
            param = None
            detail = (first.get("ctx") or {}).get("error", message)
            message = f"the body is not valid JSON ({detail})"
        elif param is None and first.get("type") == "model_attributes_type":
            message = "the body must be a JSON object (Content-Type: application/json)"
        return APIError(400, f"{param}: {message}" if param else message, param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()


def _location(errors: Sequence[Any]) -> list[str]:
    """Where the first validation error is: the path that the errors on its field share (a
    value that fits no member of a union, ``prompt: {}``, fails once per member, each path
    ending in that member's type: ``prompt.str``, ``prompt.list[int]``...)."""
    paths = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    if not paths:
        return []
    common = paths[0]
    for path in paths[1:]:
        if path[:1] == common[:1]:
            size = 0
            while size < min(len(common), len(path)) and common[size] == path[size]:
                size += 1
            common = common[:size]
    return common
