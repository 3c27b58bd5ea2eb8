"""Which engine ``generate`` and ``chat`` talk to: one they launch, a running one at an IPC
address (``ipc://...``, ``tcp://...``: a ``Client``), or ``mpengine serve``'s OpenAI API at
an HTTP URL (``http://HOST:PORT``, ``https://...``: :class:`HttpClient`, standard library
only).

:class:`HttpClient` answers the calls the commands make of a ``Client`` (``stream``,
``generate_many``, ``chat_stream``) with ``RequestOutput`` objects, so the commands print
both the same way. Its requests carry the sampling flags given (``args.given_sampling``):
the server fills in the rest with its defaults. Token ids come back as vLLM's
``return_token_ids``; logprobs as ``return_tokens_as_token_ids`` names them
(``"token_id:42"``), so each is keyed by its id as a ``Client``'s are. Leaving a stream
early closes the connection, which aborts the request on the server.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import ssl
import sys
import urllib.parse
from collections.abc import Iterator
from typing import Any

from mpengine.cli.args import (
    NONE,
    auth_token_from_args,
    config_from_args,
    given_engine_flags,
    given_sampling,
    sampling_from_args,
)
from mpengine.errors import InvalidRequestError, RequestFailedError

HTTP_SCHEMES = ("http://", "https://")
# What generate and chat launch without a model named: a real one (the tiny built-ins, the
# engine's default, have random weights).
DEFAULT_MODEL = "smollm2-135m"


def is_http(address: str) -> bool:
    return address.startswith(HTTP_SCHEMES)


@contextlib.contextmanager
def engine_client(args: argparse.Namespace) -> Iterator[Any]:
    """The client a command talks through: a ``Client`` of the engine it launches (from the
    engine flags) or of the one at ``--address``, or an :class:`HttpClient`."""
    address = args.engine_address
    if address is None:
        from mpengine.launch import Engine

        if args.model is NONE:
            args.model = DEFAULT_MODEL
        with Engine(config_from_args(args)) as engine, engine.client() as client:
            yield client
        return
    flags = given_engine_flags(args)
    model = flags.pop("model", None)
    ignored = set(flags) - {"auth_token", "log_level"}
    if ignored:
        names = ", ".join("--" + name.replace("_", "-") for name in sorted(ignored))
        print(f"mpengine: note: {names}: no effect on a running engine", file=sys.stderr)
    if is_http(address):
        api_key = args.api_key if args.api_key is not None else os.environ.get("MPENGINE_API_KEY")
        with contextlib.closing(HttpClient(address, api_key, args.timeout, model)) as client:
            yield client
        return
    from mpengine.cli.args import check_address
    from mpengine.client.sync_client import Client

    if model is not None:
        raise SystemExit(
            f"mpengine: the engine at {address} runs its own model: give MODEL to launch an "
            "engine, or to name one that the server at an http:// address serves"
        )
    if args.api_key is not None:
        raise SystemExit("mpengine: --api-key is for an http:// address (ipc: --auth-token)")
    check_address(address)
    token = auth_token_from_args(args)
    with Client(address, timeout=args.timeout, auth_token=token) as client:
        yield client


def request_params(client: Any, args: argparse.Namespace, cli_defaults: dict | None = None) -> Any:
    """The sampling a command's requests carry: ``SamplingParams`` from the flags, the
    model's defaults and the CLI's for an engine; only the flags given for a server."""
    if isinstance(client, HttpClient):
        fields = given_sampling(args)
        sampling_from_args(args)  # (refuses bad values before anything is sent)
        return fields
    return sampling_from_args(args, client.info.sampling_defaults, cli_defaults)


class HttpClient:
    """``mpengine serve`` (or any OpenAI-compatible server with vLLM's extensions) at
    ``url``; ``model``: the served model to ask for (None: the server's first)."""

    def __init__(
        self, url: str, api_key: str | None, timeout: float, model: str | None = None
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.hostname is None or parts.query or parts.fragment:
            raise SystemExit(f"mpengine: {url!r} is not a server's URL (http://HOST:PORT)")
        self.url = url
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        try:
            self.port = parts.port
        except ValueError:
            raise SystemExit(f"mpengine: {url!r} has no valid port") from None
        self.base = parts.path.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self.model = model
        self._open: set[http.client.HTTPConnection] = set()

    # -- what the commands call ------------------------------------------------------------

    def stream(self, prompt: str, fields: dict[str, Any]) -> Iterator[Any]:
        """A completion's deltas as ``RequestOutput`` objects (``Client.stream``)."""
        body = self._completion_body([prompt], fields, stream=True)
        for chunk in self._events("/v1/completions", body):
            for choice in chunk.get("choices", []):
                yield _output(chunk, _sample(choice, choice.get("text", "")))

    def generate_many(self, prompts: list[str], fields: dict[str, Any]) -> list[Any]:
        """Each prompt's samples (``Client.generate_many``)."""
        from mpengine.client.outputs import RequestOutput

        body = self._completion_body(prompts, fields, stream=False)
        reply = self._json("/v1/completions", body)
        n = int(fields.get("n", 1))
        outputs = [RequestOutput(reply.get("id", ""), [], [], finished=True) for _ in prompts]
        for choice in reply.get("choices", []):
            prompt_index, sample_index = divmod(choice["index"], n)
            sample = _sample(choice, choice.get("text", ""))
            sample.index = sample_index
            outputs[prompt_index].outputs.append(sample)
        return outputs

    def chat_stream(self, messages: list[dict[str, Any]], fields: dict[str, Any]) -> Iterator[Any]:
        """A chat reply's deltas (``Client.chat_stream``)."""
        body = {**self._named(fields), "messages": messages, "stream": True}
        for chunk in self._events("/v1/chat/completions", body):
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                yield _output(chunk, _sample(choice, text))

    def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._open.clear()

    # -- HTTP --------------------------------------------------------------------------------

    def _named(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {**fields, "model": self.model} if self.model is not None else dict(fields)

    def _completion_body(self, prompts: list[str], fields: dict[str, Any], stream: bool) -> dict:
        body = {**self._named(fields), "prompt": prompts, "stream": stream}
        body["return_token_ids"] = True
        if fields.get("logprobs") is not None:
            body["return_tokens_as_token_ids"] = True
        return body

    @contextlib.contextmanager
    def _post(self, path: str, body: dict[str, Any]) -> Iterator[http.client.HTTPResponse]:
        """POST ``body`` as JSON; the response once its status is 200 (else the server's
        error, raised as the client library raises the engine's)."""
        if self.https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self._open.add(conn)
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise ConnectionError(f"cannot reach the server at {self.url}: {exc}") from None
            conn.sock.settimeout(None)  # (a long generation is no timeout: Ctrl-C stops it)
            conn.request("POST", self.base + path, json.dumps(body).encode(), headers)
            response = conn.getresponse()
            if response.status != 200:
                raise _http_error(response.status, response.read())
            yield response
        finally:
            self._open.discard(conn)
            conn.close()  # (a stream left early: the server aborts the request)

    def _json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._post(path, body) as response:
            return json.loads(response.read())

    def _events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The server-sent events' JSON objects until ``[DONE]``; an error event raises."""
        with self._post(path, body) as response:
            while True:
                line = response.readline()
                if not line:
                    raise ConnectionError(f"the server at {self.url} closed the stream early")
                if not line.startswith(b"data:"):
                    continue  # (blank lines between events, comments)
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RequestFailedError(_message(event))
                yield event


def _http_error(status: int, data: bytes) -> Exception:
    try:
        message = _message(json.loads(data))
    except ValueError:
        message = data.decode(errors="replace").strip()[:500]
    if status == 401:
        return PermissionError(f"the server refused the API key: {message}")
    if status in (400, 404, 413, 422):
        return InvalidRequestError(message)
    return RequestFailedError(f"the server answered {status}: {message}")


def _message(payload: object) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    if isinstance(payload, dict) and "detail" in payload:
        return str(payload["detail"])
    return str(payload)


def _sample(choice: dict[str, Any], text: str) -> Any:
    """A choice (or a stream's delta of one) as a ``CompletionOutput``."""
    from mpengine.client.outputs import CompletionOutput

    sample = CompletionOutput(
        choice.get("index", 0),
        text,
        list(choice.get("token_ids") or []),
        choice.get("finish_reason"),
        choice.get("stop_reason"),
    )
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and "tokens" in logprobs:
        sample.logprobs = _logprob_rows(logprobs)
    return sample


def _logprob_rows(logprobs: dict[str, Any]) -> list[dict[int, float]]:
    """A completion's logprobs (tokens named ``token_id:ID``) as ``{token id: logprob}`` per
    token, the sampled token first, as a ``Client`` gives them."""
    rows = []
    for token, value, tops in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        row = {_token_id(token): value}
        for name, top_value in (tops or {}).items():
            row.setdefault(_token_id(name), top_value)
        rows.append(row)
    return rows


def _token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def _output(chunk: dict[str, Any], sample: Any) -> Any:
    from mpengine.client.outputs import RequestOutput

    finished = sample.finish_reason is not None
    return RequestOutput(chunk.get("id", ""), [], [sample], finished=finished)
