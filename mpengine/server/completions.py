"""``POST /v1/completions``: OpenAI's text completions, with vLLM's extensions
(``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``...).

A prompt is a string, a list of strings, token ids or a list of token-id lists; each is one
engine request of ``n`` samples, and choice ``i * n + j`` is sample ``j`` of prompt ``i``.
``echo`` puts the prompt before each choice's text (and, with ``logprobs``, its tokens'
logprobs before the generated ones', the first being null); ``echo`` with ``max_tokens: 0``
returns the prompt alone, as vLLM does (how evaluation harnesses score a text: one token is
computed and dropped). ``prompt_logprobs: N`` (vLLM's) adds each choice's
``prompt_logprobs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mpengine.client.outputs import RequestOutput
from mpengine.server.errors import bad_request, invalid_value
from mpengine.server.generation import (
    Generation,
    PromptResult,
    pinned_rank,
    until_disconnected,
)
from mpengine.server.logprobs import completion_logprobs, prompt_logprob_entries
from mpengine.server.schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)
from mpengine.server.sse import DONE, event, stream_response
from mpengine.server.state import ServerState

DEFAULT_MAX_TOKENS = 16  # OpenAI's


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request
) -> Response:
    model = state.check_model(body.model)
    state.check_admitting()
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if misuse := body.misuse():
        raise bad_request(*misuse)
    # (Beams are sent whole as each ends; best_of is then the beam width, as in vLLM.)
    if body.stream and not body.use_beam_search and (body.best_of or 0) > body.n:
        raise bad_request(
            f"best_of ({body.best_of}) > n ({body.n}) cannot be streamed: the best samples "
            "are known only when all have ended",
            "best_of",
        )
    num_samples = max(body.n, body.best_of or 0)
    texts, prompts = await _prompts(state, body.prompt, body.add_special_tokens, num_samples)
    kept = state.truncate(prompts, body.truncate_prompt_tokens)
    texts = [t if len(a) == len(b) else None for t, a, b in zip(texts, prompts, kept, strict=True)]
    prompts = kept
    state.check_prompts(prompts, "prompt")
    echo_only = body.echo and body.max_tokens == 0
    if body.max_tokens is None:
        max_tokens = min(
            DEFAULT_MAX_TOKENS, state.info.sampling_defaults.get("max_tokens", 1 << 31)
        )
    else:
        max_tokens = 1 if echo_only else body.max_tokens
        state.check_context(prompts, max_tokens, "max_tokens")
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt shows its logprobs too
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    try:
        params = body.sampling_params(
            max_tokens, body.logprobs, prompt_logprobs, body.best_of, state.info.sampling_defaults
        )
    except (msgspec.ValidationError, ValueError) as exc:
        raise invalid_value(exc, body.engine_names(body.best_of)) from None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    rank = pinned_rank(state, request)
    generation = Generation(state, prompts, params, request_id, body.priority, body.user, rank)
    view = _View(state, body, model, request_id, texts, prompts, echo_only)
    if body.stream:
        return await stream_response(request, generation, view.stream(generation))
    results = await until_disconnected(request, generation.collect())
    return Response(msgspec.json.encode(view.whole(results)), media_type="application/json")


async def _prompts(
    state: ServerState,
    prompt: str | list[str] | list[int] | list[list[int]],
    add_special_tokens: bool = True,
    num_samples: int = 1,
) -> tuple[list[str | None], list[list[int]]]:
    """Each prompt's text (None for token ids) and token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list = [prompt]  # one prompt: a string or token ids
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt is empty", "prompt")
    state.check_count(len(items), "prompt", num_samples)
    texts = [item if isinstance(item, str) else None for item in items]
    strings = [t for t in texts if t is not None]
    encoded = iter(await state.text.encode(strings, add_special_tokens) if strings else [])
    ids = [next(encoded) if isinstance(item, str) else item for item in items]
    if any(not p for p in ids):
        raise bad_request("prompt is empty", "prompt")
    return texts, ids


class _View:
    """Turns outputs into OpenAI's completion objects, whole or chunk by chunk."""

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        model: str,
        request_id: str,
        texts: list[str | None],
        prompts: list[list[int]],
        echo_only: bool = False,
    ) -> None:
        self.state = state
        self.echo_only = echo_only  # the sampled token is dropped
        self.body = body
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.texts = texts
        self.prompts = prompts
        self.n = body.n
        # Per prompt, what each of its n choices repeats: built once (n times over was
        # 1.3 s on the event loop for n = 32 and an 8k-token prompt).
        self._echoes: dict[tuple[int, bool], tuple[str, CompletionLogprobs | None, int]] = {}
        self._entries: dict[int, list] = {}

    def _prompt_text(self, index: int) -> str:
        text = self.texts[index]
        return text if text is not None else self.state.text.decode(self.prompts[index])

    def _echo(
        self, index: int, prompt_logprobs: list[dict[int, float] | None] | None
    ) -> tuple[str, CompletionLogprobs | None, int]:
        """What ``echo`` puts first in a choice: the prompt's text and, with logprobs, its
        tokens' logprobs; and the text offset of the token after it."""
        key = (index, prompt_logprobs is not None)  # (a stream's may come after a choice's)
        if key not in self._echoes:
            self._echoes[key] = self._new_echo(index, prompt_logprobs)
        return self._echoes[key]

    def _new_echo(
        self, index: int, prompt_logprobs: list[dict[int, float] | None] | None
    ) -> tuple[str, CompletionLogprobs | None, int]:
        text = self._prompt_text(index)
        if self.body.logprobs is None:
            return text, None, len(text)
        ids = self.prompts[index]
        if prompt_logprobs is None:
            rows = [None] * len(ids)
        else:  # the top ``logprobs`` of rows that may hold more (``prompt_logprobs``)
            rows = [
                row and _top(row, ids[i], self.body.logprobs)
                for i, row in enumerate(prompt_logprobs)
            ]
        # Offsets count the tokens' own texts, as vLLM's do: a token that is part of a
        # character reads as U+FFFD, so they may differ from the text's length.
        as_ids = self.body.return_tokens_as_token_ids
        logprobs, offset = completion_logprobs(self.state.text, ids, rows, 0, as_ids)
        return text, logprobs, offset

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        finish_reason: str | None,
        stop_reason: str | int | None,
        token_ids: list[int],
        prompt_index: int | None,
        prompt_rows: list[dict[int, float] | None] | None = None,
        prompt_ranks: list[int | None] | None = None,
    ) -> CompletionChoice:
        """A choice; ``prompt_index`` names the prompt in the choice's first chunk only."""
        ids = self.body.return_token_ids
        prompt = None if prompt_index is None else self.prompts[prompt_index]
        num_top = self.body.prompt_logprobs
        if prompt_rows is None and prompt is not None and len(prompt) == 1:
            prompt_rows = [None]  # a first token has no logprob, as vLLM says it: [null]
        entries = None
        if num_top is not None and prompt_index is not None and prompt_rows is not None:
            if prompt_index not in self._entries:
                self._entries[prompt_index] = prompt_logprob_entries(
                    self.state.text, prompt, prompt_rows, num_top, prompt_ranks
                )
            entries = self._entries[prompt_index]
        return CompletionChoice(
            index,
            text,
            logprobs,
            finish_reason,
            stop_reason,
            token_ids if ids else None,
            prompt if ids else None,
            entries,
        )

    def whole(self, results: list[PromptResult]) -> Completion:
        choices = []
        num_generated = 0
        for prompt_index, result in enumerate(results):
            for sample_index, sample in enumerate(result.samples):
                text, logprobs, offset = "", None, 0
                if self.body.echo:
                    text, logprobs, offset = self._echo(prompt_index, result.prompt_logprobs)
                token_ids, stop_reason = sample.token_ids, sample.stop_reason
                if self.echo_only:
                    token_ids, stop_reason = [], None
                else:
                    text += sample.text
                if self.body.logprobs is not None and not self.echo_only:
                    rows = sample.logprobs or []
                    generated, _ = completion_logprobs(
                        self.state.text,
                        token_ids,
                        rows,
                        offset,
                        self.body.return_tokens_as_token_ids,
                    )
                    logprobs = _join(logprobs, generated)
                choices.append(
                    self._choice(
                        prompt_index * self.n + sample_index,
                        text,
                        logprobs,
                        "length" if self.echo_only else sample.finish_reason,
                        stop_reason,
                        token_ids,
                        prompt_index,
                        result.prompt_logprobs,
                        result.prompt_logprob_ranks,
                    )
                )
            num_generated += 0 if self.echo_only else result.num_generated
        return Completion(
            self.id, self.created, self.model, choices, usage=self._usage(num_generated)
        )

    def _usage(self, num_generated: int, prompt_index: int | None = None) -> Usage:
        """Usage of the whole request, or of one of its prompts' choices."""
        if prompt_index is None:
            num_prompt = sum(map(len, self.prompts))
        else:
            num_prompt = len(self.prompts[prompt_index])
        return Usage(num_prompt, num_generated, num_prompt + num_generated)

    def stream(
        self, generation: Generation
    ) -> Callable[[tuple[int, RequestOutput]], AsyncIterator[bytes]]:
        """``chunks(first)`` for ``stream_response``: one chunk per delta, then usage."""

        options = self.body.stream_options
        continuous = options is not None and options.continuous

        async def chunks(first: tuple[int, RequestOutput]) -> AsyncIterator[bytes]:
            offsets: dict[int, int] = {}  # choice index -> characters sent so far
            prompt_logprobs: dict[int, list] = {}
            prompt_ranks: dict[int, list | None] = {}
            generated: dict[int, int] = {}  # choice index -> tokens so far
            num_generated = 0
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                prompt_index, delta = item
                sample = delta.outputs[0]
                index = prompt_index * self.n + sample.index
                if delta.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = delta.prompt_logprobs
                    prompt_ranks[prompt_index] = delta.prompt_logprob_ranks
                text, logprobs, first = sample.text, None, None
                token_ids, stop_reason = sample.token_ids, sample.stop_reason
                finish_reason = sample.finish_reason
                if self.echo_only:
                    text, token_ids, stop_reason = "", [], None
                    finish_reason = finish_reason and "length"
                if index not in offsets:  # this choice's first chunk
                    offsets[index] = 0
                    first = prompt_index
                    if self.body.echo:
                        echoed, logprobs, offsets[index] = self._echo(
                            prompt_index, prompt_logprobs.get(prompt_index)
                        )
                        text = echoed + text
                if self.body.logprobs is not None and token_ids:
                    new_logprobs, offsets[index] = completion_logprobs(
                        self.state.text,
                        token_ids,
                        sample.logprobs or [],
                        offsets[index],
                        self.body.return_tokens_as_token_ids,
                    )
                    logprobs = _join(logprobs, new_logprobs)
                choice = self._choice(
                    index,
                    text,
                    logprobs,
                    finish_reason,
                    stop_reason,
                    token_ids,
                    first,
                    prompt_logprobs.get(prompt_index),
                    prompt_ranks.get(prompt_index),
                )
                num_generated += len(token_ids)
                generated[index] = generated.get(index, 0) + len(token_ids)
                usage = self._usage(generated[index], prompt_index) if continuous else None
                yield event(Completion(self.id, self.created, self.model, [choice], usage=usage))
                item = await generation.next()
            if options is not None and options.include_usage:
                usage = self._usage(num_generated)
                yield event(Completion(self.id, self.created, self.model, [], usage=usage))
            yield DONE

        return chunks


def _top(row: dict[int, float], token_id: int, num_top: int) -> dict[int, float]:
    """The ``num_top`` most likely entries of ``row`` and ``token_id``'s."""
    if len(row) <= num_top:
        return row
    top = dict(sorted(row.items(), key=lambda item: -item[1])[:num_top])
    top[token_id] = row[token_id]
    return top


def _join(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        first.text_offset + second.text_offset,
        first.token_logprobs + second.token_logprobs,
        first.tokens + second.tokens,
        first.top_logprobs + second.top_logprobs,
    )
