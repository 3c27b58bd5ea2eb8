"""Structured outputs end to end on the tiny model. Its weights are random, so nothing but
the grammar's mask makes its text follow a schema: every constrained output must parse and
validate (sampled at temperature 1, several samples per request), through the client
library and through the HTTP API, streamed and not, and across preemptions (a recomputed
sequence's matcher carries on where it was)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

import mpengine
from mpengine import SamplingParams
from mpengine.errors import InvalidRequestError
from mpengine.protocol import StructuredOutputs
from mpengine.testing.engine import wait_idle
from tests.e2e.test_server_cli import serving

TIMEOUT = 120.0
PROMPTS = [f"Record number {i}: describe someone" for i in range(6)]
# Bounded strings and arrays: a random model ends them only when the grammar makes it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["red", "green", "blue", "a very long choice of words"]
LARK = 'start: item ("," item)*\nitem: "a" | "b" | /[0-9]{1,3}/'
LARK_TEXT = re.compile(r"(a|b|[0-9]{1,3})(,(a|b|[0-9]{1,3}))*")
GBNF = 'root ::= "yes" | "no" | "it depends"'


def sampled(spec: StructuredOutputs, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, n=2, seed=5, structured_outputs=spec
    )


def check_text(spec: StructuredOutputs, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    elif spec.grammar == LARK:
        assert LARK_TEXT.fullmatch(text), text
    else:
        assert text in ("yes", "no", "it depends")


SPECS = [
    StructuredOutputs(json=json.dumps(SCHEMA)),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=CHOICES),
    StructuredOutputs(grammar=LARK),
    StructuredOutputs(grammar=GBNF),
]


@pytest.fixture(scope="module")
def client(start_engine) -> Iterator[mpengine.Client]:
    engine = start_engine(model="tiny", num_gpu_blocks_override=256, max_num_seqs=16)
    with engine.client(timeout=TIMEOUT) as client:
        yield client


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_every_output_follows_its_grammar(client: mpengine.Client, spec) -> None:
    outs = client.generate_many(PROMPTS, sampled(spec))
    texts = [o.text for out in outs for o in out.outputs]
    assert len(texts) == 2 * len(PROMPTS)
    for out in outs:
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text  # the grammar ended it, with EOS
            check_text(spec, o.text)
    assert len(set(texts)) > 1  # sampled, not one forced answer


def test_json_object_starts_an_object_and_ends_where_it_closes(client: mpengine.Client) -> None:
    spec = StructuredOutputs(json_object=True)
    outs = client.generate_many(PROMPTS, sampled(spec, max_tokens=40))
    for out in outs:
        for o in out.outputs:
            assert o.text.startswith("{")
            if o.finish_reason == "stop":
                assert isinstance(json.loads(o.text), dict)


def test_constrained_and_free_requests_share_steps(client: mpengine.Client) -> None:
    """A batch mixing constrained rows, free ones, penalties and logprobs: each is what it
    is alone (the masks go to their own rows)."""
    spec = StructuredOutputs(choice=CHOICES)
    free = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=30, temperature=1.0, seed=4, repetition_penalty=1.3, structured_outputs=spec
    )
    greedy = SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, structured_outputs=spec)
    params = [free, penalised, greedy]
    alone = [client.generate(PROMPTS[0], p).outputs[0] for p in params]
    together = [out.outputs[0] for out in client.generate_many([PROMPTS[0]] * 3, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert together[1].text in CHOICES and together[2].text in CHOICES
    assert len(together[0].token_ids) == 8
    assert together[2].logprobs is not None and len(together[2].logprobs) == len(
        together[2].token_ids
    )


def test_bad_grammars_are_the_requests_error(client: mpengine.Client) -> None:
    cases = [
        (StructuredOutputs(regex="[a-"), "structured_outputs.regex"),
        (StructuredOutputs(json='{"type": "strin"}'), "structured_outputs.json"),
        (StructuredOutputs(json="{not json"), "structured_outputs.json"),
        (StructuredOutputs(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ]
    for spec, field in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(field)):
            client.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec))
    out = client.generate("x", sampled(StructuredOutputs(regex=REGEX)))  # still serving
    assert re.fullmatch(REGEX, out.outputs[0].text)


def test_what_cannot_be_combined_is_refused() -> None:
    spec = StructuredOutputs(regex=REGEX)
    for extra in ({"use_beam_search": True, "n": 2}, {"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match=r"structured[ _]outputs"):
            SamplingParams(structured_outputs=spec, **extra)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex=REGEX, choice=["a"])


def test_matchers_carry_on_across_preemptions(start_engine, client: mpengine.Client) -> None:
    """Too few blocks for every sequence: constrained sequences are preempted and
    recomputed, and draw exactly what they draw with room (seeded draws depend on the
    sequence alone)."""
    spec = StructuredOutputs(grammar='start: /[a-z ]{40,60}/ "."')
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=11, structured_outputs=spec)
    prompts = [f"{i} " + "words of a long prompt " * 6 for i in range(8)]
    roomy = client.generate_many(prompts, params)
    small = start_engine(
        model="tiny", num_gpu_blocks_override=14, max_num_seqs=8, max_num_batched_tokens=64
    )
    with small.client(timeout=TIMEOUT) as tight:
        crowded = tight.generate_many(prompts, params)
        stats = wait_idle(tight)
    assert stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in crowded] == [o.outputs[0].token_ids for o in roomy]
    for out in crowded:
        assert re.fullmatch(r"[a-z ]{40,60}\.", out.outputs[0].text)


# -- over HTTP -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root: Path = tmp_path_factory.mktemp("structured")
    flags = ["--model", "tiny", "--max-num-seqs", "8", "--num-gpu-blocks-override", "256"]
    with serving(root, *flags) as served:
        yield openai.OpenAI(base_url=served.base_url, api_key="none", timeout=TIMEOUT)
    assert served.proc.returncode == 0, served.log()


def test_chat_response_format_json_schema(api: openai.OpenAI) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    messages = [{"role": "user", "content": "Describe someone as JSON."}]
    reply = api.chat.completions.create(
        model="tiny",
        messages=messages,
        response_format=response_format,
        n=3,
        seed=2,
        max_tokens=120,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = api.chat.completions.create(
        model="tiny",
        messages=messages,
        response_format=response_format,
        seed=2,
        max_tokens=120,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply.choices[0].message.content  # the same seed, streamed


def test_completions_take_vllms_fields(api: openai.OpenAI) -> None:
    cases = [
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"grammar": GBNF}}, lambda t: t in ("yes", "no", "it depends")),
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
    ]
    for extra, valid in cases:
        reply = api.completions.create(
            model="tiny", prompt="Answer:", max_tokens=60, n=2, seed=1, extra_body=extra
        )
        for choice in reply.choices:
            assert valid(choice.text), (extra, choice.text)


def test_http_errors_name_the_field(api: openai.OpenAI) -> None:
    cases = [
        ({"guided_regex": "[a-"}, "structured_outputs.regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "structured_outputs.json",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex, guided_choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"guided_choice": []}, "guided_choice"),
    ]
    for extra, named in cases:
        with pytest.raises(openai.BadRequestError, match=re.escape(named)):
            api.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
