"""A chat request's ``tools`` and ``tool_choice``, as vLLM serves them.

- ``none`` (or no tools): the tools are rendered into the prompt (the chat template's
  ``tools``); the output is text.
- a named function (``{"type": "function", "function": {"name": ...}}``): structured
  outputs force the output to be that function's arguments (its ``parameters`` schema);
  the reply is one call, its arguments streamed as they are generated.
- ``required``: structured outputs force a JSON list of one or more
  ``{"name": ..., "parameters": {...}}``, each a tool of the request with arguments valid
  for it; the reply is those calls (``finish_reason: "tool_calls"``).
- ``auto`` (OpenAI's default when tools are given): the model decides; its calls are read
  from its output in its own format (``tool_parsers``), which needs
  ``--enable-auto-tool-choice --tool-call-parser NAME``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from mpengine.protocol import SamplingParams
from mpengine.server.schemas import FunctionCall, ToolCallDelta
from mpengine.server.tool_parsers import PARSERS, StreamedCalls, ToolCall, ToolParser, new_call_id

AUTO_NEEDS_FLAGS = (
    "tool_choice 'auto' (the default with tools) needs the server started with "
    "--enable-auto-tool-choice --tool-call-parser NAME ({}); or give tool_choice 'none', "
    "'required' or a named function"
)


class ToolChoiceError(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's output is read: ``mode`` (none, named, required, auto), the named
    function, the parser of ``auto``, and the structured outputs that force the calls."""

    mode: str
    name: str | None = None
    parser: ToolParser | None = None
    structured: dict[str, Any] | None = None

    @property
    def calls(self) -> bool:
        return self.mode != "none"

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """A choice's finish reason: ``tool_calls`` where ``auto`` or ``required`` made
        calls (a named function keeps the output's, as vLLM's)."""
        if reason is not None and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, text, new_call_id())]
        if self.mode == "required":
            return None, required_calls(text)
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.parse(text)
        return text, []


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parser: str | None
) -> ToolPlan:
    """The request's plan; raises :class:`ToolChoiceError` naming the field at fault."""
    schemas = _function_schemas(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none")
    if not schemas:
        raise ToolChoiceError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto":
        if parser is None:
            raise ToolChoiceError(AUTO_NEEDS_FLAGS.format(", ".join(PARSERS)), "tool_choice")
        return ToolPlan("auto", parser=PARSERS[parser]())
    if tool_choice == "required":
        return ToolPlan("required", structured={"json": json.dumps(_required_schema(schemas))})
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolChoiceError(
                "a named tool choice is {'type': 'function', 'function': {'name': NAME}}",
                "tool_choice",
            )
        if name not in schemas:
            raise ToolChoiceError(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return ToolPlan("named", name=name, structured={"json": json.dumps(schemas[name])})
    raise ToolChoiceError(
        f"tool_choice {tool_choice!r}: 'none', 'auto', 'required' or a named function",
        "tool_choice",
    )


def with_tools(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """``params`` with the structured outputs that force the plan's calls, and the special
    tokens kept where the parser reads them; raises :class:`ToolChoiceError` for structured
    outputs the request asked for too (both cannot hold), ``ValueError`` for what cannot go
    with them."""
    if plan.structured is None and (plan.parser is None or not plan.parser.needs_special_tokens):
        return params
    fields = msgspec.to_builtins(params)
    if plan.structured is not None:
        if params.structured_outputs is not None:
            raise ToolChoiceError(
                f"tool_choice {plan.mode!r} sets the output's format itself: give no "
                "response_format or structured outputs with it",
                "tool_choice",
            )
        fields["structured_outputs"] = plan.structured
    else:
        fields["skip_special_tokens"] = False
    return msgspec.convert(fields, SamplingParams)


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a ``required`` output (its grammar made it a valid list; a list cut
    short by ``max_tokens`` gives none)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [
        ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False), new_call_id())
        for item in items
        if isinstance(item, dict) and "name" in item and "parameters" in item
    ]


def _function_schemas(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Each function's parameters schema by name (any object where it gives none)."""
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolChoiceError("a tool is {'type': 'function', 'function': {...}}", f"tools.{i}")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolChoiceError("a function needs a name", f"tools.{i}.function.name")
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise ToolChoiceError(
                "parameters is a JSON schema (an object)", f"tools.{i}.function.parameters"
            )
        schemas[function["name"]] = parameters
    return schemas


def _required_schema(schemas: dict[str, Any]) -> dict[str, Any]:
    """vLLM's schema of ``required``: a non-empty list of calls of the given functions.
    Their ``$defs`` move to the root, where their ``#/$defs/...`` references point (as
    pydantic's schemas of nested models have them)."""
    calls, defs = [], {}
    for name, schema in schemas.items():
        schema = dict(schema)
        for key, value in (schema.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise ToolChoiceError(
                    f"two functions define {key!r} in their $defs differently", "tools"
                )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    root: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if defs:
        root["$defs"] = defs
    return root


class ToolStream:
    """One streamed choice under a plan: :meth:`feed` each text delta, then :meth:`finish`;
    each returns (content to send, None for none; the tool-call deltas to send)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self.text = ""  # (required: the whole list, parsed at the end)
        self.stream = StreamedCalls(plan.parser) if plan.parser is not None else None

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        mode = self.plan.mode
        if mode == "named":  # the arguments, streamed as generated
            assert self.plan.name is not None
            if self.num_calls == 0:
                return None, self._deltas([ToolCall(self.plan.name, text, new_call_id())])
            return None, [ToolCallDelta(0, FunctionCall(arguments=text))] if text else []
        if mode == "required":
            self.text += text
            return None, []
        if self.stream is not None:
            content, calls = self.stream.feed(text)
            return content or None, self._deltas(calls)
        return text, []

    def finish(self) -> tuple[str | None, list[ToolCallDelta]]:
        if self.plan.mode == "required":
            return None, self._deltas(required_calls(self.text))
        if self.stream is not None:
            content, calls = self.stream.finish()
            return content or None, self._deltas(calls)
        return None, []

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        deltas = []
        for call in calls:
            function = FunctionCall(call.name, call.arguments)
            deltas.append(ToolCallDelta(self.num_calls, function, call.id, "function"))
            self.num_calls += 1
        return deltas
