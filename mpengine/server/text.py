"""Text in and out of token ids for the HTTP API: the model's tokenizer and chat template.

The front end runs beside the engine, so it reads the engine's tokenizer directory
(``EngineInfo.tokenizer``): ``tokenizer.json`` through ``tokenizers`` (no transformers
import, no torch in this process) and the chat template through
:mod:`mpengine.chat_template` (the one implementation the client library uses too); here
its errors become 400s naming the request field.

``mpengine serve --chat-template`` replaces the model's template (a file, or the template's
text), as vLLM's flag does; ``--chat-template-content-format`` says how a message's content
reaches it (see ``chat_template``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import Tokenizer

from mpengine import chat_template
from mpengine.chat_template import (
    CONTENT_FORMATS,
    ChatTemplate,
    ChatTemplateError,
    detect_content_format,
    load_chat_template,
)
from mpengine.client.tokens import as_transformers_encodes, encode_texts, off_the_loop
from mpengine.output.detokenizer import REPLACEMENT, token_bytes
from mpengine.server.errors import bad_request

__all__ = [
    "CONTENT_FORMATS",
    "TextTools",
    "detect_content_format",
    "load_chat_template",
    "message_dicts",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _as_400(work: Callable[[], T]) -> T:
    """``work()``, a ``ChatTemplateError`` raised as the 400 naming its field."""
    try:
        return work()
    except ChatTemplateError as exc:
        raise bad_request(str(exc), exc.param) from None


NO_TEMPLATE = (
    "the model has no chat template: send a prompt to /v1/completions, or start the server "
    "with --chat-template FILE"
)


class TextTools:
    """The server's tokenizer and chat template. ``max_tokens``: the most tokens a text may
    become (``max_model_len``); a text too long to fit, whatever it holds, is refused before
    it is tokenized (see :meth:`encode`)."""

    def __init__(
        self,
        tokenizer_dir: str,
        chat_template: str | None = None,
        content_format: str = "auto",
        max_tokens: int | None = None,
    ) -> None:
        path = Path(tokenizer_dir) / "tokenizer.json"
        self.tokenizer = (
            as_transformers_encodes(Tokenizer.from_file(str(path))) if path.exists() else None
        )
        self.max_tokens = max_tokens
        # No token stands for more characters than its spelling in the vocabulary has (a
        # byte-level token's characters are bytes, a SentencePiece one's are its own).
        self.max_token_chars = (
            max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
            if self.tokenizer is not None
            else 1
        )
        self.chat = ChatTemplate.from_dir(
            tokenizer_dir, chat_template, content_format=content_format
        )

    @property
    def template(self) -> Any:
        """The compiled chat template (None: chat is off)."""
        return self.chat.template

    @property
    def special_tokens(self) -> dict[str, Any]:
        return self.chat.special_tokens

    @property
    def content_format(self) -> str:
        return self.chat.content_format

    # -- tokens ------------------------------------------------------------------------------

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request("the model has no tokenizer.json: send token ids", "prompt")
        return self.tokenizer

    async def encode(
        self, texts: list[str], add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[list[int]]:
        """Token ids of each text; long texts are tokenized off the event loop, so that a
        multi-megabyte prompt does not stall the other requests. A text longer than
        ``max_tokens`` tokens can spell is a 400 (naming ``field``) at once: tokenizing it
        took seconds and gigabytes only to refuse it."""
        tokenizer = self._require_tokenizer()
        if self.max_tokens is not None:
            limit = self.max_tokens * self.max_token_chars
            longest = max(map(len, texts), default=0)
            if longest > limit:
                raise bad_request(
                    f"{field}: a text of {longest:,} characters is more than the "
                    f"{self.max_tokens:,} tokens of the model's context can hold (at most "
                    f"{self.max_token_chars} characters a token)",
                    field,
                )
        return await off_the_loop(texts, lambda: encode_texts(tokenizer, texts, add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._require_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them (``"Ġworld"`` in a byte-level BPE), as
        vLLM's ``/tokenize`` returns them (``convert_ids_to_tokens``)."""
        tokenizer = self._require_tokenizer()
        return [tokenizer.id_to_token(t) or "" for t in token_ids]

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one instance per server)
    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (logprobs): a token that is part of a character
        reads as U+FFFD, as in OpenAI's and vLLM's outputs."""
        return self._require_tokenizer().decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one instance per server)
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (chat logprobs' ``bytes``, from which a
        client rebuilds characters split across tokens): those of its text, or for a part
        of a character, which reads as U+FFFD, the part's own bytes."""
        text = self.token_text(token_id)
        if REPLACEMENT in text:
            raw = token_bytes(self._require_tokenizer(), token_id)
            if raw is not None:
                return raw
        return text.encode()

    # -- chat --------------------------------------------------------------------------------

    def message_dicts(self, messages: list[Any]) -> list[dict[str, Any]]:
        """The request's messages in the form this template expects."""
        return message_dicts(messages, self.content_format)

    def render_chat(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        """The prompt text (``ChatTemplate.render``'s arguments), a template's error as a 400."""
        if self.template is None:
            raise bad_request(NO_TEMPLATE, "messages")
        return _as_400(lambda: self.chat.render(messages, *args, **kwargs))


def message_dicts(messages: list[Any], content_format: str = "string") -> list[dict[str, Any]]:
    """The request's messages (``ChatMessage`` models) as the template expects them (see
    ``chat_template.message_dicts``)."""
    records = [message.model_dump(exclude_none=True) for message in messages]
    return _as_400(lambda: chat_template.message_dicts(records, content_format))
