"""Text in and out of token ids for the HTTP API: the model's tokenizer and chat template.

The front end runs beside the engine, so it reads the engine's tokenizer directory
(``EngineInfo.tokenizer``): ``tokenizer.json`` through ``tokenizers`` (no transformers
import, no torch in this process) and the chat template from ``chat_template.jinja`` or
``tokenizer_config.json``, rendered with jinja2 the way transformers renders it (a
sandboxed environment, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, transformers' ``tojson`` and ``{% generation %}``; the special tokens,
``tools`` and ``documents`` as variables; reasoning under each of its names; a final
message continued where a tag placed after its text ends up). A rendered template already
holds the model's special tokens, so it is encoded without adding any.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mpengine.client import as_transformers_encodes, encode_texts, off_the_loop
from mpengine.server.errors import bad_request

logger = logging.getLogger(__name__)

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of a message to continue


class TextTools:
    def __init__(self, tokenizer_dir: str) -> None:
        directory = Path(tokenizer_dir)
        path = directory / "tokenizer.json"
        self.tokenizer = (
            as_transformers_encodes(Tokenizer.from_file(str(path))) if path.exists() else None
        )
        config = _read_json(directory / "tokenizer_config.json")
        # What transformers hands a template besides the messages (its special tokens map).
        self.special_tokens: dict[str, Any] = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        if isinstance(extra_tokens := config.get("additional_special_tokens"), list):
            self.special_tokens["additional_special_tokens"] = list(map(_token_text, extra_tokens))
        self.template = _load_template(directory, config)

    # -- tokens ------------------------------------------------------------------------------

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request("the model has no tokenizer.json: send token ids", "prompt")
        return self.tokenizer

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; long texts are tokenized off the event loop, so that a
        multi-megabyte prompt does not stall the other requests."""
        tokenizer = self._require_tokenizer()
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

    # -- chat --------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        if self.template is None:
            raise bad_request(
                "the model has no chat template: send a prompt, not messages", "messages"
            )
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt exclude each other",
                "continue_final_message",
            )
        messages = [_alias_reasoning(message) for message in messages]
        if continue_final_message:
            # Mark where the final message's text ends, render, and cut there: the model
            # continues it (transformers' way, which a search for the text gets wrong when
            # the text is empty, trimmed by the template, or appears again after it).
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise bad_request(
                    "continue_final_message needs a final message with text content",
                    "continue_final_message",
                )
            messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
        context = {
            "tools": None,
            "documents": None,
            **self.special_tokens,
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self.template.render(**context)
        except Exception as exc:  # raise_exception, undefined names, a filter's TypeError...
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        if continue_final_message:
            tag = CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise bad_request(
                    "the chat template drops part of the final message: it cannot be continued",
                    "continue_final_message",
                )
            cut = text.rindex(tag)
            if text[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG:
                text = text[:cut]
            else:  # the template trims what it renders: so goes the text's own trailing space
                text = text[:cut].rstrip()
        return text


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as the template expects them: text parts joined into one string, and
    a missing or null ``content`` (an assistant turn that called tools) as ``""``, as vLLM
    passes it: templates read ``message['content']`` unguarded."""
    result = []
    for message in messages:
        record = message.model_dump(exclude_none=True)
        content = record.setdefault("content", "")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise bad_request(
                        f"content parts of type {part.get('type')!r} are not supported: "
                        "this server serves text models",
                        "messages",
                    )
                texts.append(str(part.get("text", "")))
            record["content"] = "\n".join(texts)  # as vLLM joins text parts
        result.append(record)
    return result


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
        return str(token.get("content", ""))
    return str(token) if token is not None else ""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: JSON without jinja's HTML escaping, its options exposed."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read (``reasoning_content``,
    ``thinking``), from whichever one it came in, as transformers 5 passes it."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` around an assistant's text: transformers
    tracks where it lies (for training masks); rendering a prompt needs only the text."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _load_template(directory: Path, config: dict[str, Any]) -> jinja2.Template | None:
    jinja_file = directory / "chat_template.jinja"  # where transformers 5 saves it
    source = jinja_file.read_text() if jinja_file.exists() else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        logger.warning("the model's chat template does not compile, chat is off: %s", exc)
        return None
