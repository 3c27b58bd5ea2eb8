"""mpengine/server/tool_parsers.py and tool_calls.py: each parser reads its format's calls
from a whole output and from a stream cut at every character, holding back only what may
start a call; tool_choice becomes the structured outputs that force the calls."""

from __future__ import annotations

import json

import pytest

from mpengine.server.tool_calls import ToolChoiceError, plan_tools, required_calls
from mpengine.server.tool_parsers import PARSERS, StreamedCalls

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "UTC"}
OUTPUTS = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "time", "arguments": TIME})
        + "\n</tool_call>",
        "Let me check.\n",
    ),
    "llama3_json": (
        "<|python_tag|>"
        + json.dumps({"name": "weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "time", "parameters": TIME}),
        None,
    ),
    "mistral": (
        "Sure [TOOL_CALLS]"
        + json.dumps(
            [{"name": "weather", "arguments": WEATHER}, {"name": "time", "arguments": TIME}]
        ),
        "Sure ",
    ),
}


@pytest.mark.parametrize("name", list(PARSERS))
def test_whole_outputs(name: str) -> None:
    text, content = OUTPUTS[name]
    got_content, calls = PARSERS[name]().parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", WEATHER),
        ("time", TIME),
    ]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("chatcmpl-tool-")
    plain = "No tools needed: the answer is 4."
    assert PARSERS[name]().parse(plain) == (plain, [])


@pytest.mark.parametrize("name", list(PARSERS))
def test_streams_cut_anywhere(name: str) -> None:
    text, content = OUTPUTS[name]
    stream = StreamedCalls(PARSERS[name]())
    sent, calls = "", []
    for char in text:
        delta, done = stream.feed(char)
        sent += delta
        calls += done
    delta, done = stream.finish()
    sent += delta
    calls += done
    assert sent == (content or "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", WEATHER),
        ("time", TIME),
    ]


def test_hermes_sends_each_call_at_its_closing_tag() -> None:
    text, _ = OUTPUTS["hermes"]
    stream = StreamedCalls(PARSERS["hermes"]())
    first_end = text.index("</tool_call>") + len("</tool_call>")
    _, calls = stream.feed(text[:first_end])
    assert [c.name for c in calls] == ["weather"]


def test_text_that_only_looks_like_calls_stays_content() -> None:
    for name, text in (
        ("hermes", "a <tool_call>{not json</tool_call>"),
        ("mistral", "[TOOL_CALLS] nope"),
    ):
        assert PARSERS[name]().parse(text) == (text, [])
        stream = StreamedCalls(PARSERS[name]())
        sent = stream.feed(text)[0] + stream.finish()[0]
        assert sent == text
    stream = StreamedCalls(PARSERS["hermes"]())
    assert stream.feed("x <tool_") == ("x ", [])  # held back: it may start a call
    assert stream.feed("z") == ("<tool_z", [])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "time"}},
]


def test_tool_choices_become_structured_outputs() -> None:
    assert plan_tools(None, None, None).mode == "none"
    assert plan_tools(TOOLS, "none", None).structured is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    assert json.loads(named.structured["json"]) == TOOLS[0]["function"]["parameters"]
    assert named.read('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    required = plan_tools(TOOLS, "required", None)
    schema = json.loads(required.structured["json"])
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = required_calls('[{"name": "time", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [("time", "{}")]
    assert plan_tools(TOOLS, "auto", "hermes").parser.name == "hermes"
    assert plan_tools(TOOLS, None, "hermes").mode == "auto"


@pytest.mark.parametrize(
    ("tools", "choice", "field", "match"),
    [
        (TOOLS, "auto", "tool_choice", "--enable-auto-tool-choice --tool-call-parser"),
        (TOOLS, None, "tool_choice", "--enable-auto-tool-choice"),
        (None, "required", "tool_choice", "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not among"),
        (TOOLS, "sometimes", "tool_choice", "'none', 'auto'"),
        ([{"type": "function", "function": {}}], "required", "tools.0.function.name", "name"),
        ([{"type": "retrieval"}], "required", "tools.0", "function"),
    ],
)
def test_bad_tool_choices_name_the_field(tools, choice, field: str, match: str) -> None:
    with pytest.raises(ToolChoiceError, match=match) as error:
        plan_tools(tools, choice, None)
    assert error.value.field == field


def test_required_moves_the_functions_defs_to_the_root() -> None:
    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    nested = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}}
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {**nested, "$defs": d}}}
        for n, d in (("a", {"City": city}), ("b", {"City": city}))
    ]
    schema = json.loads(plan_tools(tools, "required", None).structured["json"])
    assert schema["$defs"] == {"City": city}
    assert all("$defs" not in c["properties"]["parameters"] for c in schema["items"]["anyOf"])
    tools[1]["function"]["parameters"]["$defs"] = {"City": {"type": "string"}}
    with pytest.raises(ToolChoiceError, match="'City'"):
        plan_tools(tools, "required", None)
