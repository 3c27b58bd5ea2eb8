"""A model's chat template, rendered the way transformers renders it, for every front end:
the HTTP server (``server/text.py``), the client library (``Client.chat``) and the CLI.

The template and the special tokens it reads come from the model's tokenizer files
(:data:`mpengine.protocol.CHAT_TEMPLATE_FILES`): ``chat_template.jinja`` (where
transformers 5 saves it) or ``tokenizer_config.json``'s ``chat_template``, and
``bos_token``, ``eos_token``... from ``tokenizer_config.json``, else
``special_tokens_map.json`` (older models). The server reads them from the engine's
directory; a client gets their bytes from the engine (``TokenizerFile.chat_files``), so
that chat works from any host. Rendering uses jinja2 as transformers does: a sandboxed
environment, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``,
transformers' ``tojson`` and ``{% generation %}``; the special tokens, ``tools`` and
``documents`` as variables; reasoning under each of its names; a final message continued
where a tag placed after its text ends up. A rendered template already holds the model's
special tokens, so it is encoded without adding any.

A message's content reaches the template as vLLM passes it (``content_format``): as one
string (text parts joined by newlines), or as OpenAI's list of ``{"type": "text", "text":
...}`` parts for templates that loop over the parts; ``auto`` reads the template to find
out which it expects.

What a caller got wrong raises :class:`ChatTemplateError` (a ``ValueError``) with the
request field to blame in ``param``; the server turns it into a 400, the client into
``InvalidRequestError``. No torch, no transformers, no HTTP stack here.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mpengine.protocol import CHAT_TEMPLATE_FILES

logger = logging.getLogger(__name__)

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of a message to continue
CONTENT_FORMATS = ("auto", "string", "openai")
# Content parts that are text, and the field holding it (the OpenAI Responses API's input
# and output text; an assistant's refusal, which the openai client sends back).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Filters whose result is still what they were given (a list of messages, a message...).
KEEPING_FILTERS = ("list", "reverse", "selectattr", "rejectattr", "sort", "unique", "default")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplate:
    """A model's compiled chat template (``template`` is None when it has none, or one that
    does not compile) and the variables transformers hands it."""

    def __init__(
        self,
        source: str | None,
        special_tokens: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> None:
        self.source = source
        self.template = compile_template(source) if source is not None else None
        self.special_tokens = dict(special_tokens or {})
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content format {content_format!r} is not one of {CONTENT_FORMATS}")
        if content_format == "auto":
            content_format = detect_content_format(source) if source is not None else "string"
        self.content_format = content_format

    @classmethod
    def from_files(
        cls,
        files: Mapping[str, bytes | str],
        chat_template: str | None = None,
        content_format: str = "auto",
    ) -> ChatTemplate:
        """The template of a model whose tokenizer files (by name, those of
        ``CHAT_TEMPLATE_FILES`` it has) are ``files``; ``chat_template`` replaces the
        model's own (its text)."""
        config = _json_of(files.get("tokenizer_config.json"))
        # What transformers hands a template besides the messages (its special tokens map:
        # tokenizer_config.json's, else special_tokens_map.json's).
        legacy = _json_of(files.get("special_tokens_map.json"))
        tokens: dict[str, Any] = {
            name: _token_text(config.get(name) or legacy.get(name)) for name in SPECIAL_TOKENS
        }
        extra = config.get("additional_special_tokens") or legacy.get("additional_special_tokens")
        if isinstance(extra, list):
            tokens["additional_special_tokens"] = list(map(_token_text, extra))
        source = chat_template
        if source is None:
            source = _model_template(_text_of(files.get("chat_template.jinja")), config)
        return cls(source, tokens, content_format)

    @classmethod
    def from_dir(
        cls, directory: str | os.PathLike[str], chat_template: str | None = None, **kwargs: Any
    ) -> ChatTemplate:
        """The template of the model (tokenizer) in ``directory``."""
        return cls.from_files(read_chat_files(directory), chat_template, **kwargs)

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Messages (dicts) in the form this template expects (see :func:`message_dicts`)."""
        return message_dicts(messages, self.content_format)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's prompt text; ``extra``: more template variables
        (``tools``, ``chat_template_kwargs``)."""
        if self.template is None:
            raise ChatTemplateError(
                "the model has no chat template: send a prompt, not messages", "messages"
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
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
                raise ChatTemplateError(
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
            raise ChatTemplateError(f"the chat template failed: {exc}", "messages") from None
        if continue_final_message:
            tag = CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ChatTemplateError(
                    "the chat template drops part of the final message: it cannot be continued",
                    "continue_final_message",
                )
            cut = text.rindex(tag)
            if text[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG:
                text = text[:cut]
            else:  # the template trims what it renders: so goes the text's own trailing space
                text = text[:cut].rstrip()
        return text


def read_chat_files(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """The files of ``CHAT_TEMPLATE_FILES`` that ``directory`` holds, by name."""
    files = {}
    for name in CHAT_TEMPLATE_FILES:
        try:
            files[name] = (Path(directory) / name).read_bytes()
        except OSError:  # (absent: most models have one or two of them)
            continue
    return files


def message_dicts(
    messages: Sequence[Mapping[str, Any]], content_format: str = "string"
) -> list[dict[str, Any]]:
    """Chat messages (dicts, left unchanged) as the template expects them, as vLLM passes
    them: content as one string (text parts joined by newlines) or, in the ``openai``
    format, as a list of text parts (a string becomes one part); a missing or null
    ``content`` (an assistant turn that called tools) as ``""`` or no parts: templates read
    ``message['content']`` unguarded. Tool calls as tool-use templates expect them
    (``_tool_calls``)."""
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(
                "a message is a dict with a 'role' string and a 'content'", f"messages.{i}"
            )
        record = copy.deepcopy(dict(message))
        content = record.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ChatTemplateError(
                f"content is text or a list of parts, not {type(content).__name__}",
                f"messages.{i}.content",
            )
        texts = [content] if isinstance(content, str) else []
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in TEXT_PARTS:
                raise ChatTemplateError(
                    f"content parts of type {kind!r} are not supported: text only "
                    f"({', '.join(TEXT_PARTS)})",
                    f"messages.{i}.content.{j}.type",
                )
            text = part.get(TEXT_PARTS[kind])
            if not isinstance(text, str):
                raise ChatTemplateError(
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


def message_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The messages' text, as one string or OpenAI's parts (to judge how long they are)."""
    texts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p.get("text", "") for p in content if isinstance(p, Mapping)]
    return texts


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
        raise ChatTemplateError("tool_calls must be a list", f"messages.{index}.tool_calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ChatTemplateError(
                "a tool call needs a 'function' object", f"messages.{index}.tool_calls.{j}"
            )
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError as exc:
                raise ChatTemplateError(
                    f"a tool call's arguments are not JSON: {exc}",
                    f"messages.{index}.tool_calls.{j}.function.arguments",
                ) from None


def _text_of(data: bytes | str | None) -> str | None:
    if isinstance(data, bytes):
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None
    return data


def _json_of(data: bytes | str | None) -> dict[str, Any]:
    try:
        value = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
        return str(token.get("content", ""))
    return str(token) if token is not None else ""


def _model_template(jinja_file: str | None, config: dict[str, Any]) -> str | None:
    source = jinja_file if jinja_file is not None else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


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
    """A chat template given by a user (``--chat-template``, ``chat_template=``) as vLLM
    reads it: a file's text, or the template itself; a value that names no file and looks
    like no template is a mistyped path. Raises ``ValueError`` with the reason, also when
    the template does not compile."""
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
