"""What every endpoint of the front end shares."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mpengine.client.async_client import AsyncClient
from mpengine.metrics import ServerMetrics
from mpengine.protocol import EngineInfo, SamplingParams
from mpengine.server.errors import APIError
from mpengine.server.health import EngineMonitor
from mpengine.server.text import TextTools

MIN_BODY_BYTES = 64 * 1024


@dataclass(slots=True)
class ServerState:
    client: AsyncClient
    info: EngineInfo
    text: TextTools
    metrics: ServerMetrics
    monitor: EngineMonitor
    model_names: list[str]  # the first is the one responses name
    api_key: str | None = None
    access_log: bool = True  # an access line per HTTP request (request_logs.AccessLog)
    log_requests: bool = False  # a line per engine request (--enable-log-requests)
    tool_parser: str | None = None  # tool_choice "auto" (--enable-auto-tool-choice)
    body_timeout_s: float = 60.0  # a request body must arrive within this
    stream_stall_s: float = 10.0  # a stream whose client reads nothing this long is aborted
    draining: bool = False  # new requests get 503; set by the drain at shutdown
    num_inflight: int = 0  # HTTP requests with engine requests open (see Generation)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_body_bytes(self) -> int:
        """The largest request body: a prompt's ids as JSON text take up to ~3 times their
        size in the engine's frame (``max_request_bytes``)."""
        return max(MIN_BODY_BYTES, 4 * self.info.max_request_bytes)

    def check_model(self, name: str | None) -> str:
        """The name responses give: the one the request used, which must be one this server
        serves (None: the first)."""
        if name is None:
            return self.model_name
        if name in self.model_names:
            return name
        message = f"the model {name!r} does not exist; this server serves {self.model_names}"
        raise APIError(404, message, "model", "model_not_found")

    def check_count(self, num_prompts: int, param: str, num_samples: int = 1) -> None:
        """A request of more sequences (prompts times samples) than one tenant may queue
        (an HTTP request is one, see ``Generation``; half of ``max_waiting_requests``) is
        a 400: a 503 "retry later" would never succeed. One prompt always fits (an empty
        queue takes it). Checked before the prompts are looked at one by one."""
        share = self.info.max_waiting_requests // 2
        num_seqs = num_prompts * num_samples
        if share and num_prompts > 1 and num_seqs > share:
            raise APIError(
                400,
                f"{num_prompts} prompts of {num_samples} samples in one request: the engine "
                f"queues at most {share} sequences of one request (half of "
                f"max_waiting_requests={self.info.max_waiting_requests}); send fewer",
                param,
            )

    def check_prompts(self, prompts: list[list[int]], param: str) -> None:
        """Every prompt of a request can generate: its ids are in the vocabulary and it
        leaves room in the context. Checked before anything is submitted, so a request
        with one bad prompt of several is a 400 even when it streams (the engine would
        refuse that prompt only once the others' first tokens were on their way); and
        likewise for prompts that together exceed one tenant's share of the queue."""
        vocab, limit = self.info.vocab_size, self.info.max_model_len
        total, share = sum(map(len, prompts)), self.info.max_waiting_tokens // 2
        if share and len(prompts) > 1 and total > share:
            raise APIError(
                400,
                f"{total} prompt tokens in one request: the engine queues at most {share} of "
                f"one request (half of max_waiting_tokens={self.info.max_waiting_tokens}); "
                "send fewer per request",
                param,
            )
        for index, prompt in enumerate(prompts):
            where = param if len(prompts) == 1 else f"{param}[{index}]"
            if len(prompt) >= limit:
                raise APIError(
                    400,
                    f"{where} has {len(prompt)} tokens; max_model_len is {limit} and at "
                    "least one must be left to generate",
                    param,
                )
            if min(prompt) < 0 or max(prompt) >= vocab:  # the scan below only names it
                bad = next(t for t in prompt if not 0 <= t < vocab)
                raise APIError(
                    400,
                    f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                    param,
                )

    def truncate(self, prompts: list[list[int]], limit: int | None) -> list[list[int]]:
        """vLLM's ``truncate_prompt_tokens``: the last K tokens of each prompt (-1: as many
        as leave room for one generated token)."""
        if limit is None:
            return prompts
        if limit == 0 or limit < -1:
            message = "truncate_prompt_tokens must be -1 (all that fit) or >= 1"
            raise APIError(400, message, "truncate_prompt_tokens")
        params = SamplingParams(truncate_prompt_tokens=limit)
        return [params.truncated(prompt, self.info.max_model_len) for prompt in prompts]

    def check_context(self, prompts: list[list[int]], max_tokens: int, param: str) -> None:
        """An explicit ``max_tokens`` must fit in the context after every prompt (a 400
        naming it, as OpenAI and vLLM answer), rather than being cut short silently. A
        prompt that fills the context alone is the engine's to refuse (naming the prompt)."""
        longest = max(map(len, prompts))
        limit = self.info.max_model_len
        if longest < limit < longest + max_tokens:
            raise APIError(
                400,
                f"{param} ({max_tokens}) is too large: the model's context is {limit} tokens "
                f"and the prompt has {longest}, so at most {limit - longest} can be "
                "generated",
                param,
            )

    def check_admitting(self) -> None:
        """New requests get 503 once the server drains or the engine is gone."""
        if self.draining:
            message = "the server is draining: it admits no new requests"
            raise APIError(503, message, code="draining")
        if self.monitor.dead:
            raise APIError(
                503, f"the engine is not running: {self.monitor.dead}", code="engine_dead"
            )
