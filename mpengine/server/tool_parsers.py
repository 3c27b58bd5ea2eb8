"""Tool calls in a model's own output format (``tool_choice: "auto"`` with
``--enable-auto-tool-choice --tool-call-parser NAME``), as vLLM's parsers of those names
read them:

- ``hermes`` (Qwen 2.5 and 3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call, after any text;
- ``llama3_json`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}``
  (or ``"arguments"``), optionally after ``<|python_tag|>``, several joined by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``,
  after any text.

A parser reads the whole text (:meth:`ToolParser.parse`) or follows a stream
(:class:`StreamedCalls`): the text before the calls streams as content, held back only
where it could be the start of a call's marker; each call is sent whole, arguments
included, once its text is complete (at its closing tag, or at the end of the output).
Text that looks like a call but does not parse stays content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(item: Any) -> ToolCall | None:
    """A ``{"name": ..., "arguments" | "parameters": {...}}`` object as a call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # (some models write the JSON as a string)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


class ToolParser:
    """One output format: where calls start (``start``), how a complete stretch of calls
    reads (:meth:`calls_in`), and whether a call can end before the output does."""

    name = ""
    start = ""  # the marker the calls follow ("" for a format whose output is only calls)
    # Special tokens the format's markers are: kept in the text the parser reads.
    needs_special_tokens = False

    def split(self, text: str) -> tuple[str, str] | None:
        """(content, the calls' text) if ``text`` has calls, else None."""
        index = text.find(self.start)
        if index < 0:
            return None
        return text[:index], text[index:]

    def calls_in(self, text: str) -> list[ToolCall] | None:
        """The calls of a complete calls' text, or None if it does not parse."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output: content None where only calls were
        generated; no calls where none parse (the text stays content)."""
        split = self.split(text)
        if split is None:
            return text, []
        content, rest = split
        calls = self.calls_in(rest)
        if not calls:
            return text, []
        return (content if content.strip() else None), calls

    def complete_prefix(self, calls_text: str) -> int:
        """How much of a stream's calls' text forms complete calls already (0 where a
        call completes only with the output)."""
        return 0


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def calls_in(self, text: str) -> list[ToolCall] | None:
        calls = []
        for closed, unclosed in self._block.findall(text):
            try:
                call = _call(json.loads(closed or unclosed))
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def complete_prefix(self, calls_text: str) -> int:
        index = calls_text.rfind(self.end)
        return index + len(self.end) if index >= 0 else 0


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"
    tag = "<|python_tag|>"

    def split(self, text: str) -> tuple[str, str] | None:
        stripped = text.lstrip()
        if stripped.startswith(self.tag):
            stripped = stripped[len(self.tag) :].lstrip()
        return ("", stripped) if stripped.startswith("{") else None

    def calls_in(self, text: str) -> list[ToolCall] | None:
        text = text.lstrip().removeprefix(self.tag)
        decoder, calls, position = json.JSONDecoder(), [], len(text) - len(text.lstrip())
        while position < len(text):
            try:
                item, position = decoder.raw_decode(text, position)
            except ValueError:
                return None
            call = _call(item)
            if call is None:
                return None
            calls.append(call)
            position = len(text) - len(text[position:].lstrip().removeprefix(";").lstrip())
        return calls or None


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    needs_special_tokens = True

    def calls_in(self, text: str) -> list[ToolCall] | None:
        try:
            items = json.loads(text[len(self.start) :])
        except ValueError:
            return None
        items = items if isinstance(items, list) else [items]
        calls = [_call(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}


class StreamedCalls:
    """One streamed choice's text through a parser: :meth:`feed` each delta, then
    :meth:`finish`; each returns (content to send, calls completed)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # all of it so far
        self.sent = 0  # characters of text sent as content
        self.calls_at: int | None = None  # where the calls began
        self.parsed = 0  # characters after calls_at already sent as calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.calls_at is None:
            split = self.parser.split(self.text)
            if split is None:
                held = self._held_back()
                content = self.text[self.sent : len(self.text) - held]
                self.sent += len(content)
                return content, []
            self.calls_at = len(split[0])
            content = self.text[self.sent : self.calls_at]
            self.sent = self.calls_at
            return content, self._complete()
        return "", self._complete()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: calls that parse, else the held text as content."""
        if self.calls_at is None:
            content = self.text[self.sent :]
            self.sent = len(self.text)
            return content, []
        rest = self.text[self.calls_at + self.parsed :]
        calls = self.parser.calls_in(rest) if rest.strip() else []
        if calls is None:  # not calls after all: the text as it was
            return rest, []
        return "", calls

    def _complete(self) -> list[ToolCall]:
        assert self.calls_at is not None
        calls_text = self.text[self.calls_at + self.parsed :]
        done = self.parser.complete_prefix(calls_text)
        if not done:
            return []
        calls = self.parser.calls_in(calls_text[:done])
        if calls is None:
            return []
        self.parsed += done
        return calls

    def _held_back(self) -> int:
        """Characters at the end that could begin the calls' marker."""
        marker = self.parser.start
        if isinstance(self.parser, Llama3JsonParser):  # calls only at the very start
            return len(self.text) if self.parser.tag.startswith(self.text.lstrip()) else 0
        for size in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-size:]):
                return size
        return 0
