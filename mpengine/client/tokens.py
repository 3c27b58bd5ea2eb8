"""Text and token ids on the client side: prompts as the int32 arrays requests carry,
tokenization that keeps an event loop free (shared with the HTTP server), and
``EngineText``, what a client fetched from the engine to turn text and conversations into
token ids: its tokenizer and its chat template's files."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from mpengine.errors import InvalidRequestError
from mpengine.protocol import INT32_MAX, Array, TokenizerFile, lone_surrogate

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from mpengine.chat_template import ChatTemplate

T = TypeVar("T")
# A conversation: OpenAI's messages, ``{"role": "user", "content": "Hi"}``...
Conversation = Sequence[Mapping[str, Any]]
MAX_CHAT_TEMPLATES = 8  # templates given per call that a client keeps compiled


def token_array(prompt: Sequence[int]) -> Array:
    """A prompt's token ids as the int32 array a request carries; anything else (bytes, a
    float, an id beyond int32) is the caller's mistake, named as such."""
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise InvalidRequestError("prompt: expected text or a list of token ids, not bytes")
    ids = prompt if isinstance(prompt, np.ndarray) else np.asarray(list(prompt))
    if ids.size:
        integral = ids.dtype.kind in "iu" or (
            ids.dtype.kind == "O" and all(type(t) is int for t in ids.flat)  # beyond int64
        )
        if ids.ndim != 1 or not integral:
            raise InvalidRequestError("prompt: token ids must be a flat list of integers")
        if ids.min() < -INT32_MAX - 1 or ids.max() > INT32_MAX:
            raise InvalidRequestError("prompt: a token id is outside int32")
    return Array.of(ids)


# asyncio front ends (``AsyncClient``, the HTTP server) tokenize texts longer than this, in
# all, in a worker thread: a multi-megabyte prompt takes seconds, which must not stall every
# other request on the event loop. ``tokenizers`` releases the GIL in ``encode_batch`` (it
# holds it in ``encode``), so the loop keeps running meanwhile.
INLINE_TOKENIZE_CHARS = 8192


def encode_texts(
    tokenizer: Tokenizer, texts: Sequence[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each text, with the GIL released (``encode_batch``). A text that is not
    Unicode (a lone UTF-16 surrogate, which JSON can escape) raises ``ValueError``."""
    try:
        encodings = tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    except TypeError:
        if any(isinstance(text, str) and lone_surrogate(text) for text in texts):
            raise ValueError("the prompt holds a lone UTF-16 surrogate: not Unicode text") from None
        raise
    return [encoding.ids for encoding in encodings]


async def off_the_loop(texts: Iterable[object], work: Callable[[], T]) -> T:
    """``work()``, in a worker thread when ``texts`` (prompts: strings or token ids) hold
    more than :data:`INLINE_TOKENIZE_CHARS` characters of text."""
    size = sum(len(t) for t in texts if isinstance(t, str))
    return work() if size <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(work)


def as_transformers_encodes(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` encoding one text as ``transformers``' ``tokenizer(text)`` does: a
    ``tokenizer.json`` may carry padding and truncation settings (all-MiniLM-L6-v2's pads
    and cuts every input to 128 tokens), which ``tokenizers`` applies and ``transformers``
    does not unless asked."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How ``chat`` renders a conversation (its keyword arguments, as vLLM's ``LLM.chat``)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> ChatOptions:
        """The options among a chat call's arguments (its ``locals()``: the calls take them
        as keywords of these names)."""
        return cls(**{option.name: arguments[option.name] for option in fields(cls)})


class EngineText:
    """What the engine shared with a client for text: its tokenizer and its chat template's
    files (one ``TokenizerFile`` reply serves both: the engine answers a client's tokenizer
    queries a few times), and the chat templates compiled from them, once each."""

    def __init__(self) -> None:
        self.tokenizer: Tokenizer | None = None  # None until fetched
        self._chat_files: dict[str, bytes] = {}
        self._templates: dict[str | None, ChatTemplate] = {}  # by template (None: model's)

    def adopt(self, reply: TokenizerFile) -> None:
        """Keep what the engine shared."""
        from tokenizers import Tokenizer

        self._chat_files = dict(reply.chat_files)
        if self.tokenizer is not None:
            return
        if not reply.data:
            raise RuntimeError("the engine has no tokenizer.json to share: send token ids")
        self.tokenizer = as_transformers_encodes(Tokenizer.from_str(reply.data.decode()))

    def tokenize(self, text: str, max_length: int | None) -> list[int]:
        """Token ids of ``text``, special tokens added as the model's tokenizer frames an
        input; ``max_length`` truncates the text's tokens so that the framed whole fits."""
        tokenizer = self._adopted()
        if max_length is None:
            return encode_texts(tokenizer, [text])[0]
        (encoding,) = tokenizer.encode_batch([text], add_special_tokens=False)
        room = max(0, max_length - tokenizer.num_special_tokens_to_add(False))
        if len(encoding.ids) > room:
            encoding.truncate(room)
        return tokenizer.post_process(encoding).ids

    def chat_ids(self, conversation: Conversation, options: ChatOptions) -> list[int]:
        """The token ids of ``conversation`` rendered by the chat template (which holds the
        special tokens: none are added, as vLLM's ``LLM.chat`` encodes it)."""
        from mpengine.chat_template import ChatTemplateError

        tokenizer = self._adopted()
        template = self._template(options.chat_template)
        extra = dict(options.chat_template_kwargs or {})
        if options.tools is not None:
            extra.setdefault("tools", options.tools)
        # As vLLM, chat_template_kwargs may say add_generation_prompt too, and win.
        prompted = bool(extra.pop("add_generation_prompt", options.add_generation_prompt))
        continued = options.continue_final_message
        try:
            if not conversation:
                raise ChatTemplateError("messages is empty: give at least one message")
            messages = template.messages(conversation)
            text = template.render(messages, prompted and not continued, continued, extra)
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc)) from None
        return encode_texts(tokenizer, [text], add_special_tokens=False)[0]

    def _adopted(self) -> Tokenizer:
        assert self.tokenizer is not None, "adopt the engine's reply first"
        return self.tokenizer

    def _template(self, source: str | None) -> ChatTemplate:
        """The model's chat template, or ``source`` (a template, or a file holding one)."""
        from mpengine.chat_template import ChatTemplate, load_chat_template

        template = self._templates.get(source)
        if template is None:
            try:
                text = load_chat_template(source) if source is not None else None
            except ValueError as exc:
                raise InvalidRequestError(f"chat_template: {exc}") from None
            template = ChatTemplate.from_files(self._chat_files, text)
            if len(self._templates) >= MAX_CHAT_TEMPLATES:
                self._templates.clear()
            self._templates[source] = template
        return template
