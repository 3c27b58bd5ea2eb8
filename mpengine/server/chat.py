"""``POST /v1/chat/completions``: messages through the model's chat template, then the same
engine request as a completion (one prompt, ``n`` samples, choice ``j`` is sample ``j``).

``max_completion_tokens`` (or ``max_tokens``) defaults to what the context has left.
``logprobs: true`` with ``top_logprobs: N`` returns each token's logprob and its N most
likely alternatives. Streaming sends each choice's role first, then its content deltas.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mpengine.chat_template import message_texts
from mpengine.client.outputs import RequestOutput
from mpengine.client.tokens import off_the_loop
from mpengine.server.errors import bad_request, invalid_value
from mpengine.server.generation import (
    Generation,
    PromptResult,
    pinned_rank,
    until_disconnected,
)
from mpengine.server.logprobs import chat_logprobs, prompt_logprob_entries
from mpengine.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    FunctionCall,
    TokenizeRequest,
    ToolCallOut,
    Usage,
)
from mpengine.server.sse import DONE, event, stream_response
from mpengine.server.state import ServerState
from mpengine.server.text import message_dicts
from mpengine.server.tool_calls import (
    ToolChoiceError,
    ToolPlan,
    ToolStream,
    plan_tools,
    with_tools,
)


def tokenize_chat(body: TokenizeRequest) -> ChatCompletionRequest:
    """The chat request whose prompt ``/tokenize`` counts: the messages, tools and template
    options given; chat's defaults for the rest (no special tokens added to the rendered
    template, as vLLM's ``TokenizeChatRequest``)."""
    given = {"add_generation_prompt", "add_special_tokens"} & body.model_fields_set
    return ChatCompletionRequest(
        messages=body.messages,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
        tools=body.tools,
        **{name: getattr(body, name) for name in given},
    )


async def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The token ids of the rendered conversation."""
    extra = dict(body.chat_template_kwargs or {})
    if body.tools:  # (with tool_choice "none": rendered, never parsed)
        extra.setdefault("tools", body.tools)
    # As vLLM, chat_template_kwargs may say add_generation_prompt too, and win.
    explicit = "add_generation_prompt" in extra or "add_generation_prompt" in body.model_fields_set
    add_generation_prompt = bool(extra.pop("add_generation_prompt", body.add_generation_prompt))
    if body.continue_final_message and add_generation_prompt and explicit:  # (as vLLM)
        raise bad_request(
            "continue_final_message and add_generation_prompt exclude each other: leave "
            "add_generation_prompt out (or false) to continue the final message",
            "continue_final_message",
        )
    messages = state.text.message_dicts(body.messages)
    # A long conversation renders in a worker thread, as long texts are tokenized: the
    # event loop goes on serving the other requests' streams (and /health) meanwhile.
    text = await off_the_loop(
        message_texts(messages),
        lambda: state.text.render_chat(
            messages,
            add_generation_prompt and not body.continue_final_message,
            body.continue_final_message,
            extra,
        ),
    )
    (ids,) = await state.text.encode([text], body.add_special_tokens, field="messages")
    return ids


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    model = state.check_model(body.model)
    state.check_admitting()
    if not body.messages:
        raise bad_request("messages is empty: give at least one message", "messages")
    if misuse := body.misuse():
        raise bad_request(*misuse)
    try:
        tools = plan_tools(body.tools, body.tool_choice, state.tool_parser)
    except ToolChoiceError as exc:
        raise bad_request(str(exc), exc.field) from None
    (prompt,) = state.truncate([await chat_prompt(state, body)], body.truncate_prompt_tokens)
    if len(prompt) >= state.info.max_model_len:
        raise bad_request(
            f"the conversation has {len(prompt)} tokens; max_model_len is "
            f"{state.info.max_model_len} and at least one must be left to generate",
            "messages",
        )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = state.info.max_model_len - len(prompt)
        max_tokens = min(max_tokens, state.info.sampling_defaults.get("max_tokens", max_tokens))
    else:
        state.check_context([prompt], max_tokens, param)
    num_top = body.top_logprobs or 0
    try:
        params = with_tools(
            body.sampling_params(
                max_tokens,
                num_top if body.logprobs else None,
                body.prompt_logprobs,
                defaults=state.info.sampling_defaults,
            ),
            tools,
        )
    except ToolChoiceError as exc:
        raise bad_request(str(exc), exc.field) from None
    except (msgspec.ValidationError, ValueError) as exc:
        names = {"logprobs": "top_logprobs", "max_tokens": param, **body.engine_names()}
        raise invalid_value(exc, names) from None
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    rank = pinned_rank(state, request)
    generation = Generation(state, [prompt], params, request_id, body.priority, body.user, rank)
    view = _View(state, body, model, request_id, prompt, num_top, tools)
    if body.stream:
        return await stream_response(request, generation, view.stream(generation))
    results = await until_disconnected(request, generation.collect())
    return Response(msgspec.json.encode(view.whole(results[0])), media_type="application/json")


class _View:
    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        model: str,
        request_id: str,
        prompt: list[int],
        num_top: int,
        tools: ToolPlan,
    ) -> None:
        self.state = state
        self.tools = tools
        self.body = body
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.prompt = prompt
        self.num_top = num_top
        # vLLM's reply role: the assistant's after a generation prompt, else the role of the
        # final message (continued, or a turn the model completes). ``echo``: a final
        # message of that role (continued with ``continue_final_message``) starts each
        # choice's content.
        kwargs = body.chat_template_kwargs or {}
        prompted = kwargs.get("add_generation_prompt", body.add_generation_prompt)
        prompted = bool(prompted) and not body.continue_final_message
        self.role = "assistant" if prompted or not body.messages else body.messages[-1].role
        last = message_dicts(body.messages[-1:])[0] if body.echo and body.messages else None
        self.echoed = last["content"] if last and last["role"] == self.role else ""

    def _logprobs(self, token_ids: list[int], rows: list | None) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        as_ids = self.body.return_tokens_as_token_ids
        return chat_logprobs(self.state.text, token_ids, rows or [], self.num_top, as_ids)

    def _usage(self, num_generated: int) -> Usage:
        return Usage(len(self.prompt), num_generated, len(self.prompt) + num_generated)

    def whole(self, result: PromptResult) -> ChatCompletion:
        ids = self.body.return_token_ids
        choices = []
        for index, sample in enumerate(result.samples):
            content, calls = self.tools.read(sample.text)
            message = AssistantMessage(
                self.echoed + content if content is not None else self.echoed or None,
                self.role,
                [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in calls],
            )
            choices.append(
                ChatChoice(
                    index,
                    message,
                    self._logprobs(sample.token_ids, sample.logprobs),
                    self.tools.finish_reason(sample.finish_reason, bool(calls)),
                    sample.stop_reason,
                    sample.token_ids if ids else None,
                )
            )
        num_generated = sum(len(sample.token_ids) for sample in result.samples)
        return ChatCompletion(
            self.id,
            self.created,
            self.model,
            choices,
            self._usage(num_generated),
            prompt_token_ids=self.prompt if ids else None,
            prompt_logprobs=None
            if self.body.prompt_logprobs is None or result.prompt_logprobs is None
            else prompt_logprob_entries(
                self.state.text,
                self.prompt,
                result.prompt_logprobs,
                self.body.prompt_logprobs,
                result.prompt_logprob_ranks,
            ),
        )

    @staticmethod
    def _tool_delta(stream: ToolStream, text: str, last: bool) -> ChatDelta:
        content, deltas = stream.feed(text)
        if last:
            rest, more = stream.finish()
            content = (content or "") + (rest or "") or None
            deltas += more
        return ChatDelta(content=content, tool_calls=deltas or None)

    def _chunk(self, choices: list[ChatChunkChoice], **extra: object) -> bytes:
        return event(ChatCompletionChunk(self.id, self.created, self.model, choices, **extra))

    def stream(
        self, generation: Generation
    ) -> Callable[[tuple[int, RequestOutput]], AsyncIterator[bytes]]:
        ids = self.body.return_token_ids
        options = self.body.stream_options
        continuous = options is not None and options.continuous

        async def chunks(first: tuple[int, RequestOutput]) -> AsyncIterator[bytes]:
            generated: dict[int, int] = {}  # choice index -> tokens so far
            calls: dict[int, ToolStream] = {}  # choice index -> its tool calls so far
            num_generated = 0
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                sample = item[1].outputs[0]
                index = sample.index
                if index not in generated:
                    generated[index] = 0
                    role = ChatChunkChoice(
                        index, ChatDelta(self.role, self.echoed), None, None, None
                    )
                    prompt_ids = self.prompt if ids and index == 0 else None
                    usage = self._usage(0) if continuous else None
                    yield self._chunk([role], prompt_token_ids=prompt_ids, usage=usage)
                finish_reason = sample.finish_reason
                if self.tools.calls:
                    stream = calls.setdefault(index, ToolStream(self.tools))
                    delta = self._tool_delta(stream, sample.text, finish_reason is not None)
                    finish_reason = self.tools.finish_reason(finish_reason, stream.called)
                else:
                    delta = ChatDelta(content=sample.text)
                choice = ChatChunkChoice(
                    index,
                    delta,
                    self._logprobs(sample.token_ids, sample.logprobs),
                    finish_reason,
                    sample.stop_reason,
                    sample.token_ids if ids else None,
                )
                num_generated += len(sample.token_ids)
                generated[index] += len(sample.token_ids)
                usage = self._usage(generated[index]) if continuous else None
                yield self._chunk([choice], usage=usage)
                item = await generation.next()
            if options is not None and options.include_usage:
                yield self._chunk([], usage=self._usage(num_generated))
            yield DONE

        return chunks
