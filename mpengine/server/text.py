"""Text in and out of token ids for the HTTP API: the model's tokenizer and chat template.

The front end runs beside the engine, so it reads the engine's tokenizer directory
(``EngineInfo.tokenizer``): ``tokenizer.json`` through ``tokenizers`` (no transformers
import, no torch in this process) and the chat template from ``chat_template.jinja`` or
``tokenizer_config.json``, rendered with jinja2 the way transformers renders it (a
sandboxed environment, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII). A rendered template already holds the
model's special tokens, so it is encoded without adding any.
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


class TextTools:
    def __init__(self, tokenizer_dir: str) -> None:
        directory = Path(tokenizer_dir)
        path = directory / "tokenizer.json"
        self.tokenizer = (
            as_transformers_encodes(Tokenizer.from_file(str(path))) if path.exists() else None
        )
        config = _read_json(directory / "tokenizer_config.json")
        self.special_tokens = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")
        }
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
        context = {
            **self.special_tokens,
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self.template.render(**context)
        except jinja2.TemplateError as exc:
            raise bad_request(f"the chat template failed: {exc}", "messages") from None
        if continue_final_message and messages:
            # End where the last message's text ends: the model continues it.
            last = str(messages[-1].get("content") or "")
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
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


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _load_template(directory: Path, config: dict[str, Any]) -> jinja2.Template | None:
    jinja_file = directory / "chat_template.jinja"  # where transformers 5 saves it
    source = jinja_file.read_text() if jinja_file.exists() else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        logger.warning("the model's chat template does not compile, chat is off: %s", exc)
        return None
