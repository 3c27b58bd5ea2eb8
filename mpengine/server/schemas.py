"""What the HTTP API takes and returns: OpenAI's shapes, with vLLM's extensions.

Requests are pydantic models (FastAPI validates bodies with them and names the field at
fault); their ranges are left to ``SamplingParams`` (``protocol.py``), the one place the
engine's bounds live, so an out-of-range value fails once, with the engine's message.
Responses are msgspec structs: a streamed completion encodes one per token, and msgspec
does that several times faster. Fields that OpenAI always sends (``finish_reason: null``)
have no default; vLLM's extensions (``token_ids``...) default to None and are left out
when unset.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from mpengine.protocol import PoolingParams, SamplingParams, lone_surrogate
from mpengine.server.structured import GUIDED_FIELDS, structured_outputs

# -- requests --------------------------------------------------------------------------------

# A token id is a JSON integer: pydantic's lax mode would take true as 1 and 4.0 as 4.
TokenId = Annotated[int, Strict()]
# A conversation's bounds, checked while the body is validated (450,000 messages took the
# event loop ~5 s to validate, then were refused): more than any model's context holds.
MAX_MESSAGES = 16_384
MAX_CONTENT_PARTS = 1_024
Messages = Annotated[list["ChatMessage"], Field(max_length=MAX_MESSAGES)]
# Prompts in one request (each an engine request; the queue holds 4,096 by default), and
# ids in one (a request frame, 4 MiB by default, holds about a million).
MAX_PROMPTS = 16_384
MAX_PROMPT_IDS = 1 << 20
Prompts = (
    str
    | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]
    | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
)


logger = logging.getLogger(__name__)

_JSON = msgspec.json.Encoder()
_IGNORED_LOGGED: set[tuple[str, str]] = set()  # (request kind, field): warned once each
CHAT_TEMPLATE_REFUSED = (
    "chat_template in a request is not accepted: the server's is used (the model's, or "
    "--chat-template)"
)


def unicode_text(value: Any) -> Any:
    """``value`` (a field's, strings nested in lists and dicts included), refused when a
    string holds a lone UTF-16 surrogate (``protocol.lone_surrogate``): the tokenizer would
    fail on it. Plain JSON values are checked by encoding them as UTF-8 at C speed (a
    prompt of a million token-id lists would take seconds one by one); others are looked
    into one by one."""
    if isinstance(value, list | dict):
        try:
            _JSON.encode(value)
        except UnicodeEncodeError:
            raise ValueError("holds a lone UTF-16 surrogate: not Unicode text") from None
        except (TypeError, msgspec.EncodeError):
            pass  # not plain JSON (a nested model): look into it one by one
        else:
            return value
    if isinstance(value, str):
        if lone_surrogate(value):
            raise ValueError("holds a lone UTF-16 surrogate: not Unicode text")
    elif isinstance(value, list | tuple):
        for item in value:
            unicode_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            unicode_text(key)
            unicode_text(item)
    return value


class RequestModel(BaseModel):
    """A request body: every string in it must be Unicode text (``unicode_text``). An
    explicit ``null`` for a field that has a default means that default (OpenAI documents
    ``n``, ``stream``, ``echo``... as nullable, and clients send ``null`` for unset ones).
    Fields the server does not know are ignored with a warning in the log, as vLLM does."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unknowns(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        if cls.model_config.get("extra") != "allow":
            for name in data.keys() - fields.keys():
                if (cls.__name__, name) not in _IGNORED_LOGGED and len(_IGNORED_LOGGED) < 256:
                    _IGNORED_LOGGED.add((cls.__name__, name))
                    logger.warning(
                        "%s: the field %r is not supported and is ignored",
                        cls.__name__,
                        name[:100],
                    )
        nulls = [
            name
            for name, value in data.items()
            if value is None
            and name in fields
            and not fields[name].is_required()
            and fields[name].default is not None
        ]
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data

    @field_validator("*")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        return unicode_text(value)

    @model_validator(mode="after")
    def _unicode_extra(self) -> RequestModel:
        for value in (self.model_extra or {}).values():
            unicode_text(value)
        return self


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(RequestModel):
    """Parameters completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:ID"
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's beam search: best_of (else n) beams, the n best returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # vLLM's: lower runs first (--scheduling-policy priority)
    # Structured outputs (``server/structured.py``): OpenAI's ``response_format``, vLLM's
    # fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    # vLLM's token constraints, refused likewise (the tokens they exclude would come back).
    allowed_token_ids: list[Any] | None = None
    bad_words: list[Any] | None = None

    def engine_names(self, best_of: int | None = None) -> dict[str, str]:
        """The request's names of engine fields it sets under another name."""
        if self.use_beam_search:
            return {"beam_width": "best_of" if best_of is not None else "n"}
        return {}

    def misuse(self) -> tuple[str, str] | None:
        """(message, field) of options that only make sense with others, as vLLM refuses them."""
        if self.stream_options is not None and not self.stream:
            return "stream_options can only be given with stream: true", "stream_options"
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name):  # (empty: no constraint)
                return f"{name} is not supported (logit_bias can ban or favour tokens)", name
        return None

    def structured_outputs_asked(self) -> dict[str, Any] | None:
        """The engine's structured outputs of this request (see ``server/structured.py``)."""
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
        return structured_outputs(self.response_format, self.structured_outputs, guided)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        best_of: int | None = None,
        defaults: dict[str, int | float] | None = None,
    ) -> SamplingParams:
        """The engine's parameters, ``defaults`` (the model's) for those the request leaves
        out; raises ``msgspec.ValidationError`` naming the field (``... - at
        `$.temperature```) or ``ValueError`` for a value out of range."""
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "n": self.n,
            "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "seed": self.seed,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "best_of": best_of,
            "logit_bias": _token_keys(self.logit_bias),
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "structured_outputs": self.structured_outputs_asked(),
        }
        if self.use_beam_search:
            fields.update(
                use_beam_search=True,
                beam_width=best_of or self.n,
                best_of=None,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
            )
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        if self.top_k is not None:
            optional["top_k"] = 0 if self.top_k == -1 else self.top_k  # vLLM's "no top-k"
        if not self.use_beam_search:  # (deterministic: the sampling knobs do not apply)
            for name, value in (defaults or {}).items():
                if optional.get(name) is None and name != "max_tokens":
                    optional[name] = value
        fields.update({name: value for name, value in optional.items() if value is not None})
        return msgspec.convert(fields, SamplingParams)


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) keyed by integers."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ValueError("logit_bias: keys must be token ids") from None


class CompletionRequest(SamplingFields):
    prompt: Prompts
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS... on text prompts


# The roles a message may have (OpenAI's, and Llama 3's ``ipython`` for tool results), and
# those whose messages need content (an assistant's may be empty, or carry tool calls).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
ROLES_NEEDING_CONTENT = frozenset({"system", "developer", "user", "tool", "function", "ipython"})


class ChatMessage(RequestModel):
    """A chat message; content is text or a list of text parts. Other fields (``name``,
    ``tool_calls``...) are handed to the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = (
        None
    )

    @model_validator(mode="after")
    def _role_and_content(self) -> ChatMessage:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"unknown role {self.role!r} (roles: {', '.join(sorted(CHAT_ROLES))})")
        if self.content is None and self.role in ROLES_NEEDING_CONTENT:
            raise ValueError(f"a message of role {self.role!r} needs content")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Messages
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's; the conversation's tokens
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's; refused: the model's own template is used
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's: the rendered template holds the special tokens already, so none by default.
    add_special_tokens: bool = False

    def misuse(self) -> tuple[str, str] | None:
        if self.chat_template is not None:
            return CHAT_TEMPLATE_REFUSED, "chat_template"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true", "top_logprobs"
        if self.stream and self.prompt_logprobs is not None:
            return "prompt_logprobs are returned whole: not with stream", "prompt_logprobs"
        return super().misuse()


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused, as for chat completions
    tools: list[dict[str, Any]] | None = None  # (messages only) rendered as chat renders them
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings request, with vLLM's ``truncate_prompt_tokens``, ``normalize``
    and ``pooling`` (None: the model's default)."""

    model: str | None = None
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Strict()] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    pooling: str | None = None
    priority: int = 0
    add_special_tokens: bool = True  # vLLM's: the tokenizer's [CLS], [SEP]... on text inputs

    def pooling_params(self) -> PoolingParams:
        """The engine's parameters; raises ``msgspec.ValidationError`` naming the field or
        ``ValueError`` for a value out of range."""
        fields = {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "dimensions": self.dimensions,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }
        given = {name: value for name, value in fields.items() if value is not None}
        return msgspec.convert(given, PoolingParams)


# -- responses -------------------------------------------------------------------------------

_OUT = {"omit_defaults": True}


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(msgspec.Struct):
    """vLLM's ``Logprob``: ``rank`` is null for a prompt token outside the top N asked for
    (its exact rank is not computed)."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(msgspec.Struct, **_OUT):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None  # always sent (vLLM's clients read it), null or not
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # vLLM's: per prompt token (the first null), it and the top ``prompt_logprobs``
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct, tag_field="object", tag="text_completion", **_OUT):
    """A whole completion, or (``stream``) one chunk of it. ``object`` is the tag, which
    ``omit_defaults`` never drops."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct, **_OUT):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, **_OUT):
    content: str | None  # null where the reply is only tool calls
    role: str
    tool_calls: list[ToolCallOut] = []


class ChatChoice(msgspec.Struct, **_OUT):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None  # always sent (vLLM's clients read it), null or not
    token_ids: list[int] | None = None


class ChatCompletion(msgspec.Struct, tag_field="object", tag="chat.completion", **_OUT):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's


class ToolCallDelta(msgspec.Struct, **_OUT):
    index: int
    function: FunctionCall
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, **_OUT):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, **_OUT):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None  # always sent (vLLM's clients read it), null or not
    token_ids: list[int] | None = None


class ChatCompletionChunk(msgspec.Struct, tag_field="object", tag="chat.completion.chunk", **_OUT):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    """OpenAI's embeddings response, with vLLM's ``id`` and ``created``."""

    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "mpengine"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct, **_OUT):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
