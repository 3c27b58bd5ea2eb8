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

``mpengine serve --chat-template`` replaces the model's template (a file, or the template's
text), as vLLM's flag does. A message's content reaches the template as vLLM passes it
(``--chat-template-content-format``): as one string (text parts joined by newlines), or as
OpenAI's list of ``{"type": "text", "text": ...}`` parts for templates that loop over the
parts; ``auto`` reads the template to find out which it expects.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mpengine.client import as_transformers_encodes, encode_texts, off_the_loop
from mpengine.output.detokenizer import REPLACEMENT, token_bytes
from mpengine.server.errors import bad_request

logger = logging.getLogger(__name__)

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of a message to continue


CONTENT_FORMATS = ("auto", "string", "openai")


class TextTools:
    def __init__(
        self, tokenizer_dir: str, chat_template: str | None = None, content_format: str = "auto"
    ) -> None:
        directory = Path(tokenizer_dir)
        path = directory / "tokenizer.json"
        self.tokenizer = (
            as_transformers_encodes(Tokenizer.from_file(str(path))) if path.exists() else None
        )
        config = _read_json(directory / "tokenizer_config.json")
        # What transformers hands a template besides the messages (its special tokens map:
        # tokenizer_config.json's, else special_tokens_map.json's, where older models keep
        # them).
        legacy = _read_json(directory / "special_tokens_map.json")
        self.special_tokens: dict[str, Any] = {
            name: _token_text(config.get(name) or legacy.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        extra_tokens = config.get("additional_special_tokens") or legacy.get(
            "additional_special_tokens"
        )
        if isinstance(extra_tokens, list):
            self.special_tokens["additional_special_tokens"] = list(map(_token_text, extra_tokens))
        source = chat_template if chat_template is not None else _model_template(directory, config)
        self.template = compile_template(source) if source is not None else None
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content format {content_format!r} is not one of {CONTENT_FORMATS}")
        if content_format == "auto":
            content_format = detect_content_format(source) if source is not None else "string"
        self.content_format = content_format

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
            content = messages[-1].get("content") if messages else None
            if isinstance(content, list) and content and isinstance(content[-1], dict):
                final = content[-1].get("text")  # OpenAI's parts: the last one is continued
                if isinstance(final, str):
                    content = [*content[:-1], {**content[-1], "text": final + CONTINUE_TAG}]
            else:
                final = content
                content = final + CONTINUE_TAG if isinstance(final, str) else None
            if not isinstance(final, str):
                raise bad_request(
                    "continue_final_message needs a final message with text content",
                    "continue_final_message",
                )
            messages[-1] = {**messages[-1], "content": content}
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


# Content parts that are text, and the field holding it (the OpenAI Responses API's input
# and output text; an assistant's refusal, which the openai client sends back).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def message_dicts(messages: list[Any], content_format: str = "string") -> list[dict[str, Any]]:
    """Chat messages as the template expects them, as vLLM passes them: content as one string
    (text parts joined by newlines) or, in the ``openai`` format, as a list of text parts (a
    string becomes one part); a missing or null ``content`` (an assistant turn that called
    tools) as ``""`` or no parts: templates read ``message['content']`` unguarded. Tool calls
    as tool-use templates expect them (``_tool_calls``)."""
    result = []
    for i, message in enumerate(messages):
        record = message.model_dump(exclude_none=True)
        content = record.get("content")
        texts = [content] if isinstance(content, str) else []
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise bad_request(
                    f"content parts of type {kind!r} are not supported: this server takes "
                    f"text only ({', '.join(TEXT_PARTS)})",
                    f"messages.{i}.content.{j}.type",
                )
            text = part.get(TEXT_PARTS[kind])
            if not isinstance(text, str):
                raise bad_request(
                    f"a {kind!r} part needs a string {TEXT_PARTS[kind]!r}, not "
                    f"{type(text).__name__}",
                    f"messages.{i}.content.{j}.{TEXT_PARTS[kind]}",
                )
            texts.append(text)
        if content_format == "openai":
            record["content"] = [{"type": "text", "text": text} for text in texts]
        else:
            record["content"] = "\n".join(texts)
        if "tool_calls" in record:
            _tool_calls(record, i)
        result.append(record)
    return result


def _tool_calls(record: dict[str, Any], index: int) -> None:
    """An assistant's past tool calls as templates read them (vLLM's normalisation): the
    arguments as a dict, not OpenAI's JSON string (rendered ``| tojson`` it was encoded
    twice), ``{}`` for empty ones; no ``tool_calls`` key for an empty list (templates take
    its presence for a tool-call turn)."""
    calls = record["tool_calls"]
    if not calls:
        del record["tool_calls"]
        return
    if not isinstance(calls, list):
        raise bad_request("tool_calls must be a list", f"messages.{index}.tool_calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(
                "a tool call needs a 'function' object", f"messages.{index}.tool_calls.{j}"
            )
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError as exc:
                raise bad_request(
                    f"a tool call's arguments are not JSON: {exc}",
                    f"messages.{index}.tool_calls.{j}.function.arguments",
                ) from None


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


def _model_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"  # where transformers 5 saves it
    source = jinja_file.read_text() if jinja_file.exists() else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def compile_template(source: str) -> jinja2.Template | None:
    """The template, or ``None`` (chat off, with a warning) when it does not compile."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        logger.warning("the chat template does not compile, chat is off: %s", exc)
        return None


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value as vLLM reads it: a file's text, or the template itself;
    a value that names no file and looks like no template is a mistyped path. Raises
    ``ValueError`` with the reason, also when the template does not compile."""
    if os.path.isfile(value):
        try:
            source = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template {value!r}: {exc}") from None
    elif any(c in value for c in "{}\n"):
        source = value
    else:
        raise ValueError(f"the chat template {value!r} looks like a path, but no such file exists")
    try:  # compiled, not only parsed: an unknown filter or test is found here
        _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: {exc} (line {exc.lineno})") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None
    return source


# Filters whose result is still what they were given (a list of messages, a message...).
KEEPING_FILTERS = ("list", "reverse", "selectattr", "rejectattr", "sort", "unique", "default")


def detect_content_format(source: str) -> str:
    """``openai`` when the template loops over a message's content (it expects OpenAI's list
    of parts), else ``string``. Follows the names the template gives the message list (``{%
    set loop_messages = messages[1:] %}``), its items (``{% for m in loop_messages %}``, ``{%
    set first = messages[0] %}``) and their content (``{% set c = m['content'] %}``)."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return "string"
    lists, items, contents = {"messages"}, set(), set()

    def name_in(node: jinja2.nodes.Node, names: set[str]) -> bool:
        return isinstance(node, jinja2.nodes.Name) and node.name in names

    def kind(node: jinja2.nodes.Node) -> str | None:
        """What an expression is: the message list, one message, or a message's content."""
        if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
            inner = kind(node.node)
            if inner == "list" and node.name in ("first", "last"):
                return "item"
            return inner if node.name in KEEPING_FILTERS else None
        if isinstance(node, jinja2.nodes.CondExpr):  # a if test else b
            return kind(node.expr1) or (kind(node.expr2) if node.expr2 is not None else None)
        if name_in(node, lists):
            return "list"
        if name_in(node, items):
            return "item"
        if name_in(node, contents):
            return "content"
        if isinstance(node, jinja2.nodes.Getitem):
            inner = kind(node.node)
            if inner == "list":
                return "list" if isinstance(node.arg, jinja2.nodes.Slice) else "item"
            if inner == "item" and isinstance(node.arg, jinja2.nodes.Const):
                return "content" if node.arg.value == "content" else None
        if isinstance(node, jinja2.nodes.Getattr) and kind(node.node) == "item":
            return "content" if node.attr == "content" else None
        return None

    def targets(node: jinja2.nodes.Node) -> list[str]:  # a name, or a tuple of names
        names = [node] if isinstance(node, jinja2.nodes.Name) else node.find_all(jinja2.nodes.Name)
        return [n.name for n in names]

    for _ in range(4):  # names defined from names: until nothing new (a few rounds suffice)
        before = len(lists) + len(items) + len(contents)
        for node in tree.find_all((jinja2.nodes.Assign, jinja2.nodes.For)):
            if isinstance(node, jinja2.nodes.For):
                what = kind(node.iter)
                if what == "content":
                    return "openai"
                if what == "list":
                    items.update(targets(node.target))
            else:
                what = kind(node.node)
                if what is not None:
                    {"list": lists, "item": items, "content": contents}[what].update(
                        targets(node.target)
                    )
        if len(lists) + len(items) + len(contents) == before:
            break
    return "string"
