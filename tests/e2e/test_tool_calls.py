"""Tool calling through ``/v1/chat/completions`` with the official ``openai`` client, on
the tiny model with a Hermes-style template (Qwen's ``<tool_call>`` format) and
``--enable-auto-tool-choice --tool-call-parser hermes``. The model's weights are random:
a named function and ``required`` must still give calls whose arguments validate (the
grammar forces them); ``auto`` is driven by a regex that makes the model write a call, so
the parser's path is the real one, streamed and not."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.test_server_cli import serving

TIMEOUT = 120.0
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]
CLOSE_LIST = {"63": 8.0}  # towards "]": the random model would add calls until max_tokens


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root: Path = tmp_path_factory.mktemp("tools")
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    flags = ["--model", "tiny", "--max-num-seqs", "8", "--num-gpu-blocks-override", "256"]
    flags += ["--chat-template", str(template)]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with serving(root, *flags) as served:
        yield openai.OpenAI(base_url=served.base_url, api_key="none", timeout=TIMEOUT)
    assert served.proc.returncode == 0, served.log()


def post(api: openai.OpenAI, path: str, body: dict) -> dict:
    """A call outside /v1 (the server's /tokenize and /detokenize)."""
    url = str(api.base_url).removesuffix("/").removesuffix("/v1") + path
    request = urllib.request.Request(url, data=json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.loads(response.read())


def streamed(chunks) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index as the deltas add up, finish reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] = call.function.name or entry["name"]
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_function_is_called_with_valid_arguments(api: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "weather"}}
    reply = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        n=3,
        seed=4,
        max_tokens=60,
    )
    for answer in reply.choices:
        (call,) = answer.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "weather" and answer.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert answer.finish_reason == "stop"  # (as vLLM's named calls)
    stream = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        seed=4,
        max_tokens=60,
        stream=True,
    )
    content, calls, _ = streamed(stream)
    assert content == "" and calls[0]["name"] == "weather"
    assert calls[0]["arguments"] == reply.choices[0].message.tool_calls[0].function.arguments


def test_required_calls_tools_of_the_request(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        n=4,
        seed=9,
        max_tokens=400,
        logit_bias=CLOSE_LIST,
    )
    names = set()
    for answer in reply.choices:
        assert answer.finish_reason == "tool_calls" and answer.message.tool_calls
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            names.add(call.function.name)
    stream = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        seed=9,
        max_tokens=400,
        logit_bias=CLOSE_LIST,
        stream=True,
    )
    _, calls, finish = streamed(stream)
    first = reply.choices[0].message.tool_calls
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in first
    ]


def test_auto_reads_the_models_own_calls(api: openai.OpenAI) -> None:
    call = '{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}'
    regex = "Checking\\.\\n<tool_call>\\n" + call.replace("{", "\\{").replace("}", "\\}")
    regex += "\\n</tool_call>"
    extra = {"structured_outputs": {"regex": regex}}
    reply = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=80, extra_body=extra
    )
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content == "Checking.\n"
    (got,) = answer.message.tool_calls
    assert got.function.name == "weather"
    assert json.loads(got.function.arguments) == {"city": "Oslo", "days": 2}
    stream = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=80,
        extra_body=extra,
        stream=True,
    )
    content, calls, finish = streamed(stream)
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("weather", {"city": "Oslo", "days": 2})
    ]
    # Without a call in the output, auto answers in text.
    plain = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["No call needed."]}},
    )
    assert plain.choices[0].message.content == "No call needed."
    assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "stop"


def test_a_conversation_with_calls_and_results_renders(api: openai.OpenAI) -> None:
    arguments = json.dumps({"city": "Lima", "days": 1})
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 24 C"},
    ]
    reply = api.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert reply.usage.prompt_tokens > 0
    ids = post(api, "/tokenize", {"model": "tiny", "messages": messages, "tools": TOOLS})
    text = post(api, "/detokenize", {"tokens": ids["tokens"]})["prompt"]
    assert '<tool_response id="call-1">\nsunny, 24 C' in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Lima", "days": 1}}' in text


def test_bad_tool_requests_name_the_field(api: openai.OpenAI) -> None:
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools.0.function.name",
        ),
    ]
    for extra, param in cases:
        body = {"tools": TOOLS, **extra}
        with pytest.raises(openai.BadRequestError) as error:
            api.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body
            )
        assert error.value.body["param"] == param, error.value.body


def test_auto_tool_choice_needs_a_parser(tmp_path: Path) -> None:
    """Refused when the flags are parsed, before the model loads."""
    command = [sys.executable, "-m", "mpengine.cli", "serve", "--enable-auto-tool-choice"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    assert "--enable-auto-tool-choice needs --tool-call-parser" in done.stderr


class City(pydantic.BaseModel):
    name: Literal["Paris", "Oslo"]
    population: int = pydantic.Field(ge=0, le=100)


class Report(pydantic.BaseModel):
    city: City  # a nested model: its schema is a $ref into $defs
    sunny: bool


def test_the_openai_clients_parse_helpers(api: openai.OpenAI) -> None:
    """``chat.completions.parse`` with a pydantic model as the response format, and a
    strict function tool made from one (``pydantic_function_tool``), whose nested models'
    ``$defs`` must survive being put in the ``required`` list's schema."""
    reply = api.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Report, max_tokens=120, seed=1
    )
    assert isinstance(reply.choices[0].message.parsed, Report)
    reply = api.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(Report)],
        tool_choice="required",
        max_tokens=300,
        seed=2,
        logit_bias=CLOSE_LIST,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Report) for c in calls)
