"""The front end's parts that need no engine: error statuses, request mapping, chat
templates, health."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from mpengine.errors import EngineDeadError, InvalidRequestError
from mpengine.metrics import ServerMetrics
from mpengine.models.resolve import resolve_model
from mpengine.models.tiny_tokenizer import sentencepiece_tokenizer
from mpengine.protocol import EngineStats, SamplingParams
from mpengine.server.chat import tokenize_chat
from mpengine.server.completions import _prompts
from mpengine.server.errors import APIError, field_of, from_engine
from mpengine.server.health import EngineMonitor
from mpengine.server.logprobs import chat_logprobs
from mpengine.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
)
from mpengine.server.state import ServerState
from mpengine.server.text import (
    TextTools,
    detect_content_format,
    load_chat_template,
    message_dicts,
)


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (InvalidRequestError("prompt_token_ids: token id 9 is outside", "invalid"), 400, None),
        (
            InvalidRequestError("the KV cache cannot hold this request", "too_large"),
            413,
            "too_large",
        ),
        (
            InvalidRequestError("overloaded: 8 requests are waiting", "overloaded"),
            503,
            "overloaded",
        ),
        (EngineDeadError("the executor stage died"), 503, "engine_dead"),
        (RuntimeError("boom"), 500, None),
    ],
)
def test_engine_errors_map_to_statuses(error: Exception, status: int, code: str | None) -> None:
    api_error = from_engine(error)
    assert (api_error.status, api_error.code) == (status, code)
    body = json.loads(api_error.response().body)
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_messages_name_their_field() -> None:
    assert field_of("Expected `float` >= 0.0 - at `$.temperature`") == "temperature"
    assert field_of("Expected `int` >= 0 - at `$.stop_token_ids[0]`") == "stop_token_ids"
    assert field_of("Expected `float` >= 0.0 - at `sampling.temperature`") == "temperature"
    assert field_of("min_tokens (5) > max_tokens (2)") == "min_tokens"
    assert field_of("prompt_token_ids: token id 9 is outside") == "prompt_token_ids"
    assert field_of("the prompt is empty") is None
    assert field_of("Expected `int` >= 0 - at `key` in `$.logit_bias`") == "logit_bias"
    assert field_of("temperature must be finite") == "temperature"
    assert field_of("stop: beam search does not support stop, logprobs") == "stop"
    with pytest.raises(ValueError) as too_long:  # (its message named no field)
        SamplingParams(stop=["x" * 4000] * 5)
    assert field_of(str(too_long.value)) == "stop"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": ["ok", "\udc00 x"]}, "prompt"),
        ({"prompt": "a", "stop": ["\ud800"]}, "stop"),
        ({"prompt": "a", "user": "\ud800"}, "user"),
        ({"prompt": "a", "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ],
)
def test_lone_surrogates_are_refused_by_field(body: dict, field: str) -> None:
    """JSON can escape a lone UTF-16 surrogate and Python decodes it; the tokenizer cannot
    take it (that was a 500)."""
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(json.loads(json.dumps(body)))
    error = caught.value.errors()[0]
    assert error["loc"] == (field,) and "surrogate" in error["msg"]


def test_token_id_lists_pass_the_text_check() -> None:
    body = {"prompt": [[5, 6, 7]] * 10_000 + [[8]], "stop": ["\u00e9\U0001f600"]}
    request = CompletionRequest.model_validate(json.loads(json.dumps(body)))
    assert len(request.prompt) == 10_001 and request.stop == ["\u00e9\U0001f600"]


def test_lone_surrogates_in_chat_messages_are_refused() -> None:
    for message in (
        {"role": "user", "content": "\ud800"},
        {"role": "\ud800", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "\ud800"}]},
        {"role": "user", "content": "x", "name": "\ud800"},  # handed to the template as is
        {"role": "assistant", "tool_calls": [{"function": {"arguments": ["\udfff"]}}]},
    ):
        with pytest.raises(ValidationError, match="surrogate"):
            ChatCompletionRequest.model_validate({"messages": [message]})
    ok = {"role": "user", "content": "h\u00e9llo \U0001f600"}  # a surrogate pair is text
    assert ChatCompletionRequest.model_validate({"messages": [ok]}).messages[0].content


def test_chat_logprob_bytes_rebuild_characters_split_across_tokens(tmp_path: Path) -> None:
    """A token that is part of a character reads as U+FFFD (as in OpenAI's and vLLM's
    outputs); its ``bytes`` are its own, so the bytes of a reply's tokens join into its
    text (byte-level BPE), and a byte-fallback token is its byte (SentencePiece)."""
    text = TextTools(resolve_model("tiny"))
    reply = "naïve 你好 🎉 Ω≈ç"
    ids = text.tokenizer.encode(reply, add_special_tokens=False).ids
    content = chat_logprobs(text, ids, [{t: -1.0} for t in ids], 0).content
    assert any(entry.token == "\ufffd" for entry in content)  # split characters here
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == reply
    sentencepiece_tokenizer().save(str(tmp_path / "tokenizer.json"))
    pieces = TextTools(str(tmp_path))
    ids = pieces.tokenizer.encode("你好", add_special_tokens=False).ids
    split = [t for t in ids if pieces.token_text(t)]  # (not the leading "▁")
    assert [pieces.token_text(t) for t in split] == ["\ufffd"] * 6
    assert b"".join(pieces.token_bytes(t) for t in split) == "你好".encode()


def test_request_maps_onto_sampling_params() -> None:
    body = CompletionRequest(prompt="x", stop="end", top_k=-1, temperature=0.5, n=2, seed=3)
    params = body.sampling_params(7, logprobs=2)
    assert (params.max_tokens, params.stop, params.top_k, params.temperature) == (
        7,
        ["end"],
        0,
        0.5,
    )
    assert (params.n, params.seed, params.logprobs) == (2, 3, 2)
    defaults = CompletionRequest(prompt="x").sampling_params(16, None)
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (1.0, 1.0, 1.0)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.top_p"):
        CompletionRequest(prompt="x", top_p=1.5).sampling_params(16, None)


def test_chat_template_renders_like_transformers(tmp_path: Path) -> None:
    text = TextTools(resolve_model("tiny"))
    messages = message_dicts(
        [
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(
                role="user",
                content=[{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            ),
        ]
    )
    rendered = text.render_chat(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi \nthere<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not text.render_chat(messages, add_generation_prompt=False).endswith("assistant\n")
    partial = message_dicts(
        [ChatMessage(role="user", content="Q"), ChatMessage(role="assistant", content="The answer")]
    )
    assert text.render_chat(partial, False, continue_final_message=True).endswith("The answer")
    with pytest.raises(APIError, match="not supported"):
        message_dicts([ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}])])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(APIError, match="no chat template"):
        TextTools(str(tmp_path)).render_chat(messages)


@pytest.mark.parametrize("final", ["|>", "\n", "end", "<", "", "The answer is "])
def test_a_continued_final_message_ends_where_transformers_ends_it(final: str) -> None:
    """The prompt ends where the final message's text does: not at the last place that text
    appears (an empty or "end" message kept the end-of-turn tokens)."""
    from transformers import AutoTokenizer

    directory = resolve_model("tiny")
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": final}]
    want = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    got = TextTools(directory).render_chat([dict(m) for m in messages], False, True)
    assert got == want


def test_templates_see_what_transformers_gives_them(tmp_path: Path) -> None:
    """tojson's options, tools/documents as none, every special token, the generation tag
    and reasoning under each name: a template using them rendered a 500 or wrong text."""
    from transformers import AutoTokenizer

    for name in os.listdir(resolve_model("tiny")):
        shutil.copy(os.path.join(resolve_model("tiny"), name), tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools is not none %}{{ tools|tojson }}{% endif %}"
        "{% for m in messages %}{{ m|tojson(sort_keys=true, separators=(',', ':')) }}"
        "{% if m.role == 'assistant' %}{% generation %}[{{ m.reasoning_content }}]"
        "{% endgeneration %}{% endif %}{% endfor %}{{ pad_token }}"
    )
    messages = [
        {"role": "user", "content": "é"},
        {"role": "assistant", "content": "x", "reasoning": "because"},
    ]
    want = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False
    )
    assert TextTools(str(tmp_path)).render_chat(messages, add_generation_prompt=False) == want


PARTS_TEMPLATE = (  # a template for OpenAI's content parts (as multimodal models' are)
    "{% set loop_messages = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% for message in loop_messages %}<{{ message.role }}>"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "[{{ part.text }}]{% endfor %}</{{ message.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize(
    "template, want",
    [
        (PARTS_TEMPLATE, "openai"),
        (
            "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set first = messages|first %}{% for c in first['content'] %}{{ c }}{% endfor %}",
            "openai",
        ),
        (
            "{% set m = messages[0] %}{% set c = m.content %}{% for x in c %}{{ x }}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages|reverse %}{% for x in m['content'] %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for key in m %}{{ key }}{% endfor %}{% endfor %}", "string"),
        ("{% for t in tools %}{% for c in t.content %}{% endfor %}{% endfor %}", "string"),
        ("{% set n = messages|length %}{% for c in n.content %}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}"
            "{% endfor %}",
            "string",
        ),
        ("{% for m in messages %", "string"),  # does not compile: chat is off anyway
    ],
)
def test_content_format_is_read_from_the_template(template: str, want: str) -> None:
    assert detect_content_format(template) == want


def test_the_model_template_takes_strings() -> None:
    assert TextTools(resolve_model("tiny")).content_format == "string"


def test_a_template_looping_over_parts_gets_parts_like_transformers(tmp_path: Path) -> None:
    """A template that loops over a message's content parts rendered nothing for a string
    (or looped over its characters): it gets OpenAI's parts, strings made into one part."""
    from transformers import AutoTokenizer

    directory = resolve_model("tiny")
    text = TextTools(directory, PARTS_TEMPLATE)
    assert text.content_format == "openai"
    messages = [
        ChatMessage(role="system", content="ignored"),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        ),
        ChatMessage(role="assistant", content="c"),
        ChatMessage(role="user", content="d"),
        ChatMessage(role="assistant"),  # no content: no parts
    ]
    got = text.render_chat(text.message_dicts(messages))
    turns = "<user>[a][b]</user><assistant>[c]</assistant><user>[d]</user>"
    assert got == turns + "<assistant></assistant><assistant>"
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The answer"}]},
    ]
    want = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        parts, chat_template=PARTS_TEMPLATE, continue_final_message=True, tokenize=False
    )
    continued = [
        ChatMessage(role="user", content="Q"),
        ChatMessage(role="assistant", content="The answer"),
    ]
    assert text.render_chat(text.message_dicts(continued), False, True) == want
    assert want.endswith("[The answer")
    # Forced either way: the tiny model's template adds the content to a string.
    forced = TextTools(directory, content_format="openai")
    with pytest.raises(APIError, match="the chat template failed"):
        forced.render_chat(forced.message_dicts(messages[3:4]))
    assert TextTools(directory, PARTS_TEMPLATE, "string").content_format == "string"


def test_chat_template_flag_reads_a_file_or_a_template(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(PARTS_TEMPLATE)
    assert load_chat_template(str(path)) == PARTS_TEMPLATE
    assert load_chat_template(PARTS_TEMPLATE) == PARTS_TEMPLATE
    with pytest.raises(ValueError, match="looks like a path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    # An unknown filter is found when the template compiles: the server started with chat
    # off, every chat request a 400 "no chat template".
    with pytest.raises(ValueError, match="does not compile: No filter named 'from_json'"):
        load_chat_template("{{ messages[0].content | from_json }}")


def test_parts_are_text_of_every_text_kind_and_strings_only() -> None:
    """input_text, output_text and refusal parts are text (as vLLM reads them); a part whose
    text is not a string is a 400 naming it (null rendered as 'None', an object as its
    Python repr)."""
    parts = [
        {"type": "text", "text": "a"},
        {"type": "input_text", "text": "b"},
        {"type": "output_text", "text": "c"},
        {"type": "refusal", "refusal": "d"},
    ]
    (record,) = message_dicts([ChatMessage(role="assistant", content=parts)])
    assert record["content"] == "a\nb\nc\nd"
    for bad in (None, 5, {"a": 1}):
        with pytest.raises(APIError, match="needs a string 'text'") as info:
            message_dicts([ChatMessage(role="user", content=[{"type": "text", "text": bad}])])
        assert info.value.param == "messages.0.content.0.text"
    with pytest.raises(APIError, match="text only") as info:
        message_dicts([ChatMessage(role="user", content=[{"type": "image_url"}])])
    assert info.value.param == "messages.0.content.0.type"


def test_past_tool_calls_reach_the_template_as_vllm_passes_them() -> None:
    """OpenAI's arguments are a JSON string: templates (``| tojson``) rendered them encoded
    twice. They are a dict, ``{}`` when empty; an empty tool_calls list is no key (templates
    took it for a tool-call turn: a 400, or the assistant's text dropped)."""

    def call(arguments: object) -> dict:
        return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}

    messages = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage(role="assistant", tool_calls=[call('{"city": "Paris"}'), call(""), call(None)]),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ChatMessage(role="assistant", content="hello", tool_calls=[]),
    ]
    records = message_dicts(messages)
    arguments = [c["function"]["arguments"] for c in records[1]["tool_calls"]]
    assert arguments == [{"city": "Paris"}, {}, {}]
    assert "tool_calls" not in records[3] and records[3]["content"] == "hello"
    with pytest.raises(APIError, match="not JSON") as info:
        message_dicts([ChatMessage(role="assistant", tool_calls=[call("{oops")])])
    assert info.value.param == "messages.0.tool_calls.0.function.arguments"


def test_special_tokens_of_older_models_come_from_special_tokens_map(tmp_path: Path) -> None:
    """bos and eos kept only in special_tokens_map.json (older models' layout) reached the
    template as empty strings; transformers reads them there."""
    from transformers import AutoTokenizer

    for name in os.listdir(resolve_model("tiny")):
        shutil.copy(os.path.join(resolve_model("tiny"), name), tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokens = {name: config.pop(name) for name in ("bos_token", "eos_token") if name in config}
    tokens.setdefault("bos_token", tokens["eos_token"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(tokens))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    want = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=False
    )
    assert want.startswith(tokens["bos_token"])
    got = TextTools(str(tmp_path)).render_chat(messages, add_generation_prompt=False)
    assert got == want


def test_null_means_the_default() -> None:
    """OpenAI documents n, stream, echo, logprobs... as nullable: a client that sends null
    for them got a 400."""
    nulls = dict.fromkeys(
        ("n", "stream", "echo", "ignore_eos", "min_tokens", "priority", "use_beam_search"), None
    )
    nulls |= {"stream_options": {"include_usage": None}, "include_stop_str_in_output": None}
    body = CompletionRequest(prompt="x", **nulls)
    assert (body.n, body.stream, body.echo, body.ignore_eos, body.min_tokens) == (
        1,
        False,
        False,
        False,
        0,
    )
    assert body.stream_options.include_usage is False
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=None, n=None)
    assert (chat.logprobs, chat.n) == (False, 1)
    with pytest.raises(ValidationError, match="prompt"):
        CompletionRequest(prompt=None)  # a required field stays required


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"allowed_token_ids": [5, 6, 7]}, "allowed_token_ids"),
        ({"bad_words": [" shipped"]}, "bad_words"),
    ],
)
def test_token_constraints_are_refused_by_both_endpoints(fields: dict, param: str) -> None:
    """Ignored before by completions: the tokens they exclude would come back, with a 200."""
    completion = CompletionRequest(prompt="x", **fields)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    for body in (completion, chat):
        message, field = body.misuse()
        assert field == param and "supported" in message
    assert CompletionRequest(prompt="x", allowed_token_ids=[], bad_words=[]).misuse() is None


@pytest.mark.parametrize(
    ("fields", "engine"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            {"json": '{"type": "x"}'},
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            {"json_object": True},
        ),
        ({"guided_json": '{"type": "object"}'}, {"json": '{"type": "object"}'}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": "start: /a/"}, {"grammar": "start: /a/"}),
        ({"structured_outputs": {"regex": "a+", "json": None}}, {"regex": "a+"}),
    ],
)
def test_structured_output_fields_map_to_the_engines(fields: dict, engine: dict | None) -> None:
    """OpenAI's and vLLM's spellings become one StructuredOutputs, on both endpoints (the
    scheduler checks the grammar itself: tests/e2e/test_structured_outputs.py)."""
    for body in (
        CompletionRequest(prompt="x", **fields),
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields),
    ):
        assert body.structured_outputs_asked() == engine
        params = body.sampling_params(max_tokens=4, logprobs=None)
        got = params.structured_outputs
        assert (got is None) == (engine is None)


def test_tool_choices_are_planned_not_refused() -> None:
    """Every tool_choice is served (tests/unit/test_tool_parsers.py); 'auto' needs the
    server's --enable-auto-tool-choice, which the plan says (not misuse)."""
    messages = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for choice in (
        None,
        "none",
        "auto",
        "required",
        {"type": "function", "function": {"name": "f"}},
    ):
        body = ChatCompletionRequest(messages=messages, tools=tools, tool_choice=choice)
        assert body.misuse() is None


def test_tools_with_tool_choice_none_reach_the_template(tmp_path: Path) -> None:
    import asyncio
    from types import SimpleNamespace

    from mpengine.server.chat import chat_prompt

    for name in os.listdir(resolve_model("tiny")):
        shutil.copy(os.path.join(resolve_model("tiny"), name), tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    state = SimpleNamespace(text=TextTools(str(tmp_path)))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="none"
    )
    ids = asyncio.run(chat_prompt(state, body))
    assert state.text.decode(ids) == "[get_weather]hi"
    # /tokenize counts the same prompt: its tools were ignored (with a warning)
    counted = TokenizeRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert asyncio.run(chat_prompt(state, tokenize_chat(counted))) == ids


def test_tokenize_takes_add_special_tokens_for_messages() -> None:
    """Chat's default (the rendered template holds its special tokens) unless the request
    says otherwise; it was ignored for messages."""
    from mpengine.server.chat import chat_prompt

    state = SimpleNamespace(text=TextTools(resolve_model("tiny-llama")))  # (adds a BOS)
    messages = [{"role": "user", "content": "hi"}]
    plain = asyncio.run(chat_prompt(state, tokenize_chat(TokenizeRequest(messages=messages))))
    given = TokenizeRequest(messages=messages, add_special_tokens=True)
    with_bos = asyncio.run(chat_prompt(state, tokenize_chat(given)))
    assert len(with_bos) == len(plain) + 1 and with_bos[1:] == plain


def test_unknown_fields_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="mpengine.server.schemas"):
        CompletionRequest(prompt="x", not_a_field_anywhere=1)
        CompletionRequest(prompt="x", not_a_field_anywhere=2)  # warned once
    warned = [r for r in caplog.records if "not_a_field_anywhere" in r.getMessage()]
    assert len(warned) == 1


def test_completion_prompts_take_add_special_tokens() -> None:
    """vLLM's add_special_tokens for text prompts (tiny-llama's tokenizer adds a BOS); it
    was ignored."""
    state = SimpleNamespace(text=TextTools(resolve_model("tiny-llama")), check_count=print)
    _, (with_bos,) = asyncio.run(_prompts(state, "hi"))
    _, (without,) = asyncio.run(_prompts(state, "hi", add_special_tokens=False))
    assert len(with_bos) == len(without) + 1 and with_bos[1:] == without


def test_a_long_chat_renders_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation of megabytes rendered on the event loop: /health and every stream
    stalled for seconds. Past the inline size it renders in a thread, to the same ids."""
    import threading

    from mpengine.client.tokens import INLINE_TOKENIZE_CHARS
    from mpengine.server.chat import chat_prompt

    text = TextTools(resolve_model("tiny"))
    threads = []
    render = text.render_chat
    monkeypatch.setattr(
        text, "render_chat", lambda *a: threads.append(threading.current_thread()) or render(*a)
    )
    state = SimpleNamespace(text=text)
    long = "word " * (INLINE_TOKENIZE_CHARS // 5 + 1)
    for content in ("short", long):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": content}])
        ids = asyncio.run(chat_prompt(state, body))
        (want,) = asyncio.run(text.encode([render(text.message_dicts(body.messages))], False))
        assert ids == want
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_a_stream_lets_the_loop_turn_between_chunks() -> None:
    """Outputs that arrive together went out without a suspension between them, so a
    connection lost at the first write was noticed (in a callback of the next loop turn)
    only after the others: asyncio logged "socket.send() raised exception." for each past
    the fifth. Each chunk now lets the loop run what is ready before the next one."""
    from mpengine.server.sse import stream_response

    class Generation:  # what stream_response uses of one
        closed = False
        state = SimpleNamespace(stream_stall_s=10.0)

        async def next(self) -> tuple[int, None]:
            return 0, None

        async def close(self) -> None:
            self.closed = True

    async def chunks(first: object) -> AsyncIterator[bytes]:
        for index in range(4):
            yield b"chunk %d" % index  # (no await: all four are ready at once)

    class Request:  # a client that stays connected
        async def receive(self) -> dict:
            await asyncio.Event().wait()
            return {}

    async def main() -> list[tuple[bytes, int]]:
        generation = Generation()
        response = await stream_response(Request(), generation, chunks)
        loop = asyncio.get_running_loop()
        turns = [0]
        seen = []
        async for data in response.body_iterator:
            seen.append((data, turns[0]))
            loop.call_soon(lambda: turns.__setitem__(0, turns[0] + 1))
        assert generation.closed
        return seen

    seen = asyncio.run(main())
    assert seen == [(b"chunk %d" % index, index) for index in range(4)]


def _stats(done: int, running: int) -> EngineStats:
    fields = dict.fromkeys(EngineStats.__struct_fields__, 0)
    fields.update(query_id=0, step=done + (1 if running else 0), done=done, num_running=running)
    return EngineStats(**fields)


def test_health_is_a_moving_counter_or_nothing_to_do() -> None:
    monitor = EngineMonitor(None, ServerMetrics("m", 16), stall_timeout=5.0)  # type: ignore[arg-type]
    assert monitor.problem(now=0.0) == "starting"
    monitor.observe(_stats(10, running=2), now=0.0)
    assert monitor.problem(now=4.0) is None
    monitor.observe(_stats(10, running=2), now=4.0)
    assert monitor.problem(now=5.5).startswith("stalled: no step finished for 6 s")
    monitor.observe(_stats(11, running=2), now=6.0)  # it moved again
    assert monitor.problem(now=6.0) is None
    monitor.observe(_stats(11, running=0), now=30.0)  # idle: nothing to move for
    assert monitor.problem(now=60.0) is None
    monitor.error = "TimeoutError: no reply"
    assert "does not answer" in monitor.problem(now=60.0)
    monitor.error, monitor.draining = None, True
    assert monitor.problem(now=60.0).startswith("draining")
    monitor.dead = "the executor stage died (exit code -9)"
    assert "dead" in monitor.status("tiny")


def test_a_request_beyond_the_queue_bounds_is_a_400() -> None:
    """A request whose prompts together exceed what the engine queues would get a 503
    "retry later" every time."""
    info = SimpleNamespace(
        vocab_size=100, max_model_len=4096, max_waiting_requests=0, max_waiting_tokens=1000
    )
    state = SimpleNamespace(info=info)
    ServerState.check_prompts(state, [[5] * 900], "prompt")  # one prompt: admitted when idle
    ServerState.check_prompts(state, [[5] * 250, [6] * 250], "prompt")
    with pytest.raises(APIError) as refused:  # more than one tenant's half of the queue
        ServerState.check_prompts(state, [[5] * 300, [6] * 300], "prompt")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "max_waiting_tokens" in refused.value.message
    info.max_waiting_requests = 128
    ServerState.check_count(state, 1, "prompt", 100)  # one prompt: admitted when idle
    ServerState.check_count(state, 8, "prompt", 8)
    with pytest.raises(APIError) as refused:
        ServerState.check_count(state, 4000, "prompt", 64)
    assert refused.value.status == 400 and "half of max_waiting_requests=128" in str(
        refused.value.message
    )


@pytest.mark.parametrize(
    "body",
    [{"prompt": [True, 5]}, {"prompt": [[5], [4.0]]}, {"prompt": "x", "stop_token_ids": [True]}],
)
def test_token_ids_are_json_integers(body: dict) -> None:
    """pydantic's lax mode took true as token 1 and 4.0 as 4."""
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_the_server_logs_its_throughput_while_it_works() -> None:
    """vLLM's servers log a line of throughput and queue now and then; this one logged
    nothing between start-up and shutdown."""
    from mpengine.server.health import StatsLog

    def stats(generated: int, computed: int, running: int, free: int) -> EngineStats:
        fields = dict.fromkeys(EngineStats.__struct_fields__, 0)
        fields.update(query_id=0, stages={}, generated_tokens=generated)
        fields.update(computed_tokens=computed, num_running=running)
        fields.update(num_blocks=100, num_free_blocks=free)
        fields.update(prefix_cache_queries=computed, prefix_cache_hits=computed // 4)
        return EngineStats(**fields)

    log = StatsLog(interval=10.0)
    assert log.line(stats(0, 0, 0, 100), now=0.0) is None  # the first reading
    assert log.line(stats(50, 500, 2, 75), now=5.0) is None  # not yet due
    line = log.line(stats(100, 1100, 2, 75), now=10.0)
    assert line == (
        "prompt 100.0 tokens/s, generation 10.0 tokens/s; 2 running, 0 waiting; "
        "KV cache 25.0% used; prefix cache hits 25.0%"
    )
    assert log.line(stats(100, 1100, 0, 100), now=20.0) is None  # idle: nothing to say
    assert log.line(stats(5, 50, 1, 90), now=30.0) is None  # counters went back: a new start
    assert log.line(stats(15, 100, 1, 90), now=40.0).startswith("prompt 4.0 tokens/s, gen")


def test_http_answers_count_known_methods_and_crashed_handlers() -> None:
    """Any token is a method to h11: each made-up one was a new series of the counter,
    for clients without a key too; and a handler that raised (the server's error handler
    answers 500, outside the counting middleware) was not counted."""
    from mpengine.server.app import CountResponses

    metrics = ServerMetrics("m", 16)

    async def crash(scope, receive, send) -> None:
        raise RuntimeError("a bug")

    async def ok(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def noop(message) -> None:
        return None

    async def main() -> None:
        state = SimpleNamespace(metrics=metrics)
        for method in ("X0", "X1", "GET"):
            await CountResponses(ok, state)(
                {"type": "http", "path": "/health", "method": method}, None, noop
            )
        with pytest.raises(RuntimeError):
            scope = {"type": "http", "path": "/v1/completions", "method": "POST"}
            await CountResponses(crash, state)(scope, None, noop)

    asyncio.run(main())
    counts = {
        tuple(s.labels.values()): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        if family.name == "http_requests"
        for s in family.samples
        if s.name == "http_requests_total"
    }
    assert counts == {
        ("/health", "other", "2xx"): 2,
        ("/health", "GET", "2xx"): 1,
        ("/v1/completions", "POST", "5xx"): 1,
    }


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "wizard", "content": "hi"}, "unknown role 'wizard'"),
        ({"role": "user", "content": None}, "a message of role 'user' needs content"),
        ({"role": "tool"}, "a message of role 'tool' needs content"),
        ({"role": "system"}, "a message of role 'system' needs content"),
    ],
)
def test_messages_need_a_known_role_and_the_content_it_needs(message: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, message])


def test_an_assistant_message_may_be_empty_or_carry_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    assert ChatCompletionRequest(messages=messages).messages[1].content is None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}]
    assert ChatCompletionRequest(messages=messages).messages[1].content is None


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing() -> None:
    """A 15 MB prompt was tokenized for 20 s (and 2.4 GB) only to be refused: a text longer
    than max_model_len tokens can spell is refused at once, naming the field."""
    text = TextTools(resolve_model("tiny"), max_tokens=16)
    limit = 16 * text.max_token_chars
    (ids,) = asyncio.run(text.encode(["a" * limit]))  # may fit: tokenized
    assert ids
    with pytest.raises(APIError, match="more than the 16 tokens") as refused:
        asyncio.run(text.encode(["ok", "a" * (limit + 1)], field="input"))
    assert refused.value.status == 400 and refused.value.param == "input"


def test_conversations_are_bounded_while_validated() -> None:
    """450,000 messages held the event loop ~5 s in validation before their refusal: the
    bounds are checked before the messages are (here ~0.25 s)."""
    from mpengine.server.schemas import MAX_CONTENT_PARTS, MAX_MESSAGES

    message = {"role": "user", "content": "x"}
    with pytest.raises(ValidationError, match=f"at most {MAX_MESSAGES} items"):
        ChatCompletionRequest(messages=[message] * 450_000)
    parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
    with pytest.raises(ValidationError, match=f"at most {MAX_CONTENT_PARTS} items"):
        ChatCompletionRequest(messages=[{"role": "user", "content": parts}])
    assert len(ChatCompletionRequest(messages=[message] * MAX_MESSAGES).messages) == MAX_MESSAGES


def test_prompts_are_bounded_while_validated() -> None:
    """15 MB of one-token prompts took 2.5 s and 1.3 GB to validate before their refusal."""
    from mpengine.server.schemas import MAX_PROMPT_IDS, MAX_PROMPTS, EmbeddingRequest

    for prompt in (
        [[1]] * (MAX_PROMPTS + 1),
        ["x"] * (MAX_PROMPTS + 1),
        [1] * (MAX_PROMPT_IDS + 1),
    ):
        with pytest.raises(ValidationError, match="too_long"):
            CompletionRequest(prompt=prompt)
        with pytest.raises(ValidationError, match="too_long"):
            EmbeddingRequest(input=prompt)
    assert len(CompletionRequest(prompt=[[1, 2]] * MAX_PROMPTS).prompt) == MAX_PROMPTS
