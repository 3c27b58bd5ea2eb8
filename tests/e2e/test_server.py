"""The OpenAI-compatible HTTP API, driven by the official ``openai`` package.

One ``mpengine serve`` for the module, started from a Hugging Face hub id found in a local
cache (a stand-in cache holding the tiny model), with two served names and an API key.
Greedy outputs through HTTP must equal the engine's through the IPC client.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mpengine
from mpengine import SamplingParams
from mpengine.models.resolve import resolve_model
from mpengine.protocol import EngineStats
from mpengine.testing.engine import wait_idle
from tests.e2e.test_server_cli import Served, serving

KEY = "test-key"
HUB_ID = "testorg/tiny-chat"
NAMES = ["tiny-chat", "tiny"]
REQUEST_TIMEOUT_S = 60.0
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
# Logprobs of one position computed in different steps (other batch shapes, another CPU's
# kernels) agree to float noise, not bit for bit: token ids are compared exactly instead.
LOGPROB_TOLERANCE = 1e-4
STALL_S = 4.0  # a stream whose client reads nothing this long is aborted


def fake_hub_cache(root: Path) -> Path:
    """A Hugging Face cache holding the tiny model as ``HUB_ID`` (the layout
    ``huggingface_hub`` reads offline: refs/main names a snapshot directory)."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    for file in Path(resolve_model("tiny")).iterdir():
        shutil.copy(file, snapshot / file.name)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve")
    hub = fake_hub_cache(root / "hub")
    flags = ["--model", HUB_ID, "--served-model-name", *NAMES, "--api-key", KEY]
    flags += ["--max-num-seqs", "8", "--max-waiting-requests", "16"]
    flags += ["--max-request-bytes", "65536", "--num-gpu-blocks-override", "256"]
    flags += ["--stream-stall-timeout", str(STALL_S)]
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    with serving(root, *flags, env=env) as served:
        yield served
    assert served.proc.returncode == 0, served.log()


@pytest.fixture(scope="module")
def api(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def ipc(server: Served) -> Iterator[mpengine.Client]:
    with mpengine.Client(server.address) as client:
        yield client


def http(
    server: Served, path: str, body: object | None = None, key: str | None = KEY
) -> tuple[int, dict]:
    """A plain HTTP call: (status, JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def greedy(ipc: mpengine.Client, ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ipc.generate(ids, params, timeout=REQUEST_TIMEOUT_S).token_ids


def tokenize(server: Served, **body: object) -> list[int]:
    status, reply = http(server, "/tokenize", body)
    assert status == 200, reply
    return reply["tokens"]


# -- models, keys, health ----------------------------------------------------------------------


def test_models_keys_and_health(server: Served, api: openai.OpenAI) -> None:
    models = api.models.list()
    assert [m.id for m in models.data] == NAMES
    assert models.data[0].model_extra["root"].endswith(SNAPSHOT)  # resolved from the cache
    for name in NAMES:
        assert api.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")
    assert http(server, "/version", key=None) == (200, {"version": mpengine.__version__})
    wrong = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, reply = http(server, "/v1/models", key=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    for path in ("/tokenize", "/detokenize"):  # work for the server: the key too
        status, reply = http(server, path, {"prompt": "x", "tokens": [1]}, key=None)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", path
    assert http(server, "/detokenize", {"tokens": [1]})[0] == 200
    # Nothing of the body is looked at without the key: not JSON, or too large, is a 401.
    for body in (b"{not json", b"x" * 300_000):
        request = urllib.request.Request(server.url + "/v1/completions", data=body)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)
        assert refused.value.code == 401, body[:10]
        assert json.loads(refused.value.read())["error"]["code"] == "invalid_api_key"
    assert http(server, "/health", key=None) == (200, {"status": "ok"})
    with pytest.raises(openai.NotFoundError) as error:
        api.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert error.value.body["param"] == "model"


def test_docs_ping_and_invocations(server: Served) -> None:
    """FastAPI's /docs and /openapi.json from the real schemas; SageMaker's /ping (health)
    and /invocations (the body's shape picks the API), the latter behind the key."""
    status, schema = http(server, "/openapi.json", key=None)
    assert status == 200 and schema["info"]["version"] == mpengine.__version__
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/invocations"):
        assert path in schema["paths"], path
    chat_schema = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat_schema["properties"]
    with urllib.request.urlopen(server.url + "/docs", timeout=REQUEST_TIMEOUT_S) as reply:
        assert reply.status == 200 and b"swagger" in reply.read().lower()
    assert http(server, "/ping", key=None) == (200, {"status": "ok"})
    assert http(server, "/ping", {}, key=None) == (200, {"status": "ok"})  # POST too
    prompt = {"prompt": "Once upon", "max_tokens": 2, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, reply = http(server, "/invocations", prompt)
    assert status == 200 and reply["object"] == "text_completion", reply
    status, reply = http(server, "/invocations", chat)
    assert status == 200 and reply["object"] == "chat.completion", reply
    assert http(server, "/invocations", prompt, key=None)[0] == 401
    status, reply = http(server, "/invocations", {"temperature": 0})
    assert status == 400 and "give messages (chat), prompt" in reply["error"]["message"]
    status, reply = http(server, "/invocations", {"prompt": "x", "n": 0})
    assert status == 400 and reply["error"]["param"] == "n", reply


# -- completions -------------------------------------------------------------------------------


def test_completion_equals_the_engine(server: Served, api: openai.OpenAI, ipc) -> None:
    prompt = "Once upon a time"
    reply = api.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    (choice,) = reply.choices
    ids = tokenize(server, prompt=prompt)
    assert choice.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["token_ids"] == greedy(ipc, ids, 8)
    assert choice.finish_reason == "length" and reply.model == "tiny"
    assert choice.model_extra["stop_reason"] is None  # sent (vLLM's clients read it)
    assert reply.object == "text_completion"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 8
    detok = http(server, "/detokenize", {"tokens": choice.model_extra["token_ids"]})
    assert detok == (200, {"prompt": choice.text})


def test_prompt_forms_and_n(api: openai.OpenAI, server: Served, ipc) -> None:
    ids = [tokenize(server, prompt=p) for p in ("The sea", "A cat sat")]
    expected = [greedy(ipc, p, 4) for p in ids]
    extra = {"ignore_eos": True, "return_token_ids": True}
    for prompt in (["The sea", "A cat sat"], ids):
        reply = api.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=4, temperature=0, n=2, extra_body=extra
        )
        assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
        for choice in reply.choices:  # choice i * n + j: prompt i; greedy samples agree
            assert choice.model_extra["token_ids"] == expected[choice.index // 2]
        assert reply.usage.prompt_tokens == sum(map(len, ids))
        assert reply.usage.completion_tokens == 16
    single = api.completions.create(model="tiny", prompt=ids[0], max_tokens=3, temperature=0)
    assert (
        single.choices[0].text
        == api.completions.create(model="tiny", prompt="The sea", max_tokens=3, temperature=0)
        .choices[0]
        .text
    )


def test_sampling_parameters(api: openai.OpenAI) -> None:
    def text(**kwargs: object) -> str:
        extra = kwargs.pop("extra_body", {})
        reply = api.completions.create(
            model="tiny", prompt="Hello", max_tokens=12, extra_body=extra, **kwargs
        )
        return reply.choices[0].text

    seeded = dict(temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 50, "min_p": 0.05})
    assert text(**seeded) == text(**seeded)
    base = api.completions.create(
        model="tiny", prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    # A stop string of plain letters past the first token (no character split in tokens).
    stop = next(
        base.text[i : i + 2]
        for i in range(3, len(base.text))
        if base.text[i : i + 2].isalpha() and base.text[i : i + 2].isascii()
    )
    stopped = api.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text.endswith(stop)
    assert base.text.startswith(stopped.text)
    penalized = api.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=12,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "min_tokens": 12},
    ).choices[0]
    assert penalized.finish_reason == "length"


def test_streaming_completion(api: openai.OpenAI) -> None:
    whole = (
        api.completions.create(
            model="tiny",
            prompt="The river",
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    chunks = list(
        api.completions.create(
            model="tiny",
            prompt="The river",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert {c.object for c in chunks} == {"text_completion"}
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streaming_n_and_prompts(api: openai.OpenAI) -> None:
    stream = api.completions.create(
        model="tiny",
        prompt=["a", "b"],
        max_tokens=5,
        n=2,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            tokens.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
            if choice.finish_reason:
                assert choice.index not in finished, "finished twice"
                finished[choice.index] = choice.finish_reason
    assert finished == dict.fromkeys(range(4), "length")
    assert all(len(t) == 5 for t in tokens.values())


def test_best_of_returns_the_best_n_and_counts_every_sample(api: openai.OpenAI) -> None:
    reply = api.completions.create(
        model="tiny",
        prompt=["a", "b"],
        max_tokens=5,
        n=2,
        best_of=4,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]  # n per prompt
    assert reply.usage.completion_tokens == 2 * 4 * 5  # all best_of samples ran
    with pytest.raises(openai.BadRequestError, match="cannot be streamed") as caught:
        api.completions.create(model="tiny", prompt="a", n=1, best_of=2, stream=True)
    assert caught.value.body["param"] == "best_of"


def test_beam_search_equals_the_client_library(api: openai.OpenAI, ipc: mpengine.Client) -> None:
    beams = dict(
        model="tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=6,
        n=2,
        best_of=4,  # vLLM's beam width
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True},
    )
    reply = api.completions.create(**beams)
    params = SamplingParams(
        max_tokens=6, n=2, use_beam_search=True, beam_width=4, length_penalty=0.5
    )
    expected = ipc.generate([5, 6, 7, 8], params, timeout=60)
    got = [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]
    assert got == [o.token_ids for o in expected.outputs]
    assert reply.usage.completion_tokens == sum(len(ids) for ids in got) > 0
    # A length penalty far out of range once killed the output stage (a float overflow).
    for penalty in (2000.0, -2000.0):
        extra = {"use_beam_search": True, "length_penalty": penalty, "return_token_ids": True}
        reply = api.completions.create(
            model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, n=2, extra_body=extra
        )
        assert all(c.model_extra["token_ids"] for c in reply.choices), penalty
    # Streamed (as vLLM allows): each beam comes whole once the search ends.
    stream = api.completions.create(stream=True, **beams)
    streamed: dict[int, list[int]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
    assert [streamed[i] for i in sorted(streamed)] == [o.token_ids for o in expected.outputs]


def test_logprobs_and_echo(api: openai.OpenAI, server: Served) -> None:
    ids = tokenize(server, prompt="Once upon")
    common = dict(
        model="tiny",
        prompt="Once upon",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    reply = api.completions.create(echo=True, **common)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith("Once upon")
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens[: len(ids)]) == "Once upon"
    for value, top in zip(lp.token_logprobs[len(ids) :], lp.top_logprobs[len(ids) :], strict=True):
        assert value == pytest.approx(max(top.values()))  # greedy: the chosen is the likeliest

    # Offsets add up the tokens' own texts, through the prompt and on (as vLLM's): a prompt
    # of parts of a character (each reads as U+FFFD) sent them backwards at the first
    # generated token.
    parts = api.completions.create(
        model="tiny", prompt=[341, 239, 234], max_tokens=2, temperature=0, logprobs=0, echo=True
    ).choices[0]
    offsets, tokens = parts.logprobs.text_offset, parts.logprobs.tokens
    assert len(offsets) == 5
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]

    # Streamed, with and without echo: the chunks' logprobs joined are the whole reply's
    # (a streamed completion with logprobs once closed without a chunk).
    for echo in (True, False):
        stream = api.completions.create(echo=echo, stream=True, **common)
        tokens, values, offsets = [], [], []
        for chunk in stream:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
        skip = 0 if echo else len(ids)
        assert tokens == lp.tokens[skip:]
        assert values == pytest.approx(lp.token_logprobs[skip:], abs=LOGPROB_TOLERANCE)
        assert offsets == [o - lp.text_offset[skip] for o in lp.text_offset[skip:]]

    # vLLM's return_tokens_as_token_ids: the same logprobs, tokens named by id.
    body = {**common["extra_body"], "return_tokens_as_token_ids": True, "return_token_ids": True}
    named = api.completions.create(echo=True, **{**common, "extra_body": body}).choices[0]
    generated = named.model_extra["token_ids"]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in ids + generated]
    assert named.logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=LOGPROB_TOLERANCE
    )
    assert named.logprobs.text_offset == lp.text_offset  # (of the text, as before)
    assert all(
        all(k.startswith("token_id:") for k in top) for top in named.logprobs.top_logprobs[1:]
    )
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Once upon"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=body,
    ).choices[0]
    want = [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert [t.token for t in chat.logprobs.content] == want
    assert all(len(t.top_logprobs) == 2 for t in chat.logprobs.content)


def test_echo_without_generation_scores_the_prompt(api: openai.OpenAI, server: Served, ipc) -> None:
    """``echo`` + ``max_tokens: 0`` returns the prompt alone with its logprobs (how
    evaluation harnesses score a text), the same as the first positions of a generation."""
    ids = tokenize(server, prompt="Once upon a time")
    common = dict(model="tiny", prompt="Once upon a time", temperature=0, logprobs=1, echo=True)
    scored = api.completions.create(max_tokens=0, **common)
    longer = api.completions.create(max_tokens=3, extra_body={"ignore_eos": True}, **common)
    choice = scored.choices[0]
    assert choice.text == "Once upon a time" and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(ids)
    assert choice.logprobs.tokens == longer.choices[0].logprobs.tokens[: len(ids)]
    # (another step's batch: the same values up to float noise, not bit for bit)
    head = longer.choices[0].logprobs.token_logprobs[: len(ids)]
    assert choice.logprobs.token_logprobs == pytest.approx(head, abs=LOGPROB_TOLERANCE)
    reference = ipc.generate(
        ids, SamplingParams(max_tokens=1, prompt_logprobs=1), timeout=REQUEST_TIMEOUT_S
    ).prompt_logprobs
    values = [None] + [row[t] for row, t in zip(reference[1:], ids[1:], strict=True)]
    assert choice.logprobs.token_logprobs == pytest.approx(values, abs=LOGPROB_TOLERANCE)

    chunks = list(api.completions.create(max_tokens=0, stream=True, **common))
    assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model="tiny", prompt="a", max_tokens=0)


def test_prompt_logprobs_in_vllm_shape(api: openai.OpenAI, server: Served, ipc) -> None:
    ids = tokenize(server, prompt="Once upon a time")
    status, reply = http(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2},
    )
    assert status == 200, reply
    rows = reply["choices"][0]["prompt_logprobs"]
    full = ipc.generate(
        ids, SamplingParams(max_tokens=1, prompt_logprobs=2), timeout=REQUEST_TIMEOUT_S
    )
    reference, ranks = full.prompt_logprobs, full.prompt_logprob_ranks
    assert len(rows) == len(ids) and rows[0] is None and ranks[0] is None
    outside = 0
    for row, ref, token, rank in zip(rows[1:], reference[1:], ids[1:], ranks[1:], strict=True):
        assert {int(t) for t in row} == set(ref)
        top = sorted(ref.items(), key=lambda item: -item[1])[:2]
        for place, (t, value) in enumerate(top, 1):
            assert row[str(t)]["rank"] == place
            assert row[str(t)]["logprob"] == pytest.approx(value, abs=LOGPROB_TOLERANCE)
        # the prompt token's rank is the engine's, exact also outside the top 2
        assert row[str(token)]["rank"] == rank and rank >= 1
        outside += rank > 2
        assert all(isinstance(entry["decoded_token"], str) for entry in row.values())
    assert outside, "a random prompt has tokens outside the top 2"
    # without it, the choice has no such field
    status, reply = http(
        server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1}
    )
    assert "prompt_logprobs" not in reply["choices"][0]
    # a one-token prompt has one position, with no logprob (the field was left out)
    body = {"model": "tiny", "prompt": ids[:1], "max_tokens": 1, "prompt_logprobs": 1}
    status, reply = http(server, "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["prompt_logprobs"] == [None], reply
    # n choices of a prompt repeat its echo and prompt logprobs (built once), streamed too
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "n": 3, "echo": True}
    body.update(logprobs=1, prompt_logprobs=2, temperature=1.0, seed=3)
    status, reply = http(server, "/v1/completions", body)
    choices = reply["choices"]
    assert status == 200 and len(choices) == 3
    assert all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    heads = [c["logprobs"]["token_logprobs"][: len(ids)] for c in choices]
    assert heads[0][0] is None and all(h == heads[0] for h in heads)
    firsts = {}
    extra = {"prompt_logprobs": 2, "seed": 3}
    standard = {k: v for k, v in body.items() if k not in extra}
    for chunk in api.completions.create(**standard, extra_body=extra, stream=True):
        for c in chunk.choices:
            firsts.setdefault(c.index, c.logprobs.token_logprobs[: len(ids)])
    assert sorted(firsts) == [0, 1, 2]
    for first in firsts.values():  # (another run: the same up to float noise)
        assert first == pytest.approx(heads[0], abs=LOGPROB_TOLERANCE)


def test_truncate_prompt_tokens_keeps_the_prompts_end(api: openai.OpenAI, server: Served, ipc):
    ids = list(range(5, 25))
    reply = api.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=3,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 4, "ignore_eos": True, "return_token_ids": True},
    )
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == 4
    assert choice.model_extra["prompt_token_ids"] == ids[-4:]
    assert choice.model_extra["token_ids"] == greedy(ipc, ids[-4:], 3)
    library = ipc.generate(ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=4))
    assert library.prompt_token_ids == ids[-4:]
    # -1: a prompt past the context keeps what fits with one token to generate
    status, reply = http(
        server,
        "/v1/completions",
        {"prompt": [5] * 5000, "max_tokens": 1, "truncate_prompt_tokens": -1},
    )
    assert status == 200 and reply["usage"]["prompt_tokens"] == 4095, reply
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a long conversation " * 10}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 6},
    )
    assert chat.usage.prompt_tokens == 6
    status, reply = http(server, "/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0})
    assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens"


def test_logit_bias_steers_and_bans_tokens(api: openai.OpenAI, server: Served, ipc) -> None:
    plain = greedy(ipc, [5, 6, 7], 4)
    forced = api.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert forced.choices[0].model_extra["token_ids"] == [42] * 4
    banned = api.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=4,
        temperature=0,
        logit_bias={str(plain[0]): -100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert banned.choices[0].model_extra["token_ids"][0] != plain[0]
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert chat.choices[0].model_extra["token_ids"] == [42] * 3
    # this server schedules first come, first served: a priority is refused, naming it
    status, reply = http(server, "/v1/completions", {"prompt": "a", "priority": 1})
    assert status == 400 and reply["error"]["param"] == "priority", reply
    for bias in ({"x": 1}, {"9999999": 1}, {"5": 500}):
        status, reply = http(server, "/v1/completions", {"prompt": "a", "logit_bias": bias})
        assert status == 400 and reply["error"]["param"] == "logit_bias", (bias, reply)


# -- chat --------------------------------------------------------------------------------------


def test_chat_follows_the_template(api: openai.OpenAI, server: Served, ipc) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    reply = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = tokenize(server, messages=messages)
    template = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour."
    rendered = template + "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenize(server, prompt=rendered, add_special_tokens=False) == ids
    assert reply.model_extra["prompt_token_ids"] == ids
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.model_extra["stop_reason"] is None
    assert choice.model_extra["token_ids"] == greedy(ipc, ids, 6)
    content = choice.logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert reply.usage.prompt_tokens == len(ids)


def test_chat_echo_starts_with_the_continued_assistant_turn(api: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    common = dict(model="tiny", messages=messages, max_tokens=4, temperature=0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = api.chat.completions.create(extra_body=extra, **common)
    echoed = api.chat.completions.create(extra_body={**extra, "echo": True}, **common)
    text = plain.choices[0].message.content
    assert echoed.choices[0].message.content == "The colour is" + text
    streamed = api.chat.completions.create(
        stream=True, extra_body={**extra, "echo": True}, **common
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "The colour is" + text
    # a request that ends with a user turn has nothing to echo
    user_only = api.chat.completions.create(
        model="tiny", messages=messages[:1], max_tokens=2, temperature=0, extra_body={"echo": True}
    )
    assert not user_only.choices[0].message.content.startswith("Name a colour")
    assert user_only.choices[0].message.role == "assistant"
    # without a generation prompt the model completes the final turn: its role, echoed
    completed = api.chat.completions.create(
        model="tiny",
        messages=messages[:1],
        max_tokens=2,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False},
    )
    assert completed.choices[0].message.role == "user"
    assert completed.choices[0].message.content.startswith("Name a colour.")


def test_chat_prompt_logprobs_parts_and_tokenize_options(server: Served, ipc) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 1}
    status, reply = http(server, "/v1/chat/completions", body)
    assert status == 200, reply
    ids = tokenize(server, messages=messages)
    rows = reply["prompt_logprobs"]
    assert (
        len(rows) == len(ids)
        and rows[0] is None
        and all(str(t) in r for t, r in zip(ids[1:], rows[1:], strict=True))
    )
    # text parts are joined with newlines, as vLLM joins them
    joined = tokenize(server, messages=[{"role": "user", "content": "a\nb"}])
    assert ids == joined
    status, reply = http(server, "/v1/chat/completions", {**body, "stream": True})
    assert status == 400 and reply["error"]["param"] == "prompt_logprobs"
    # /tokenize renders a continued final message as chat does
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    continued = tokenize(
        server, messages=turns, continue_final_message=True, add_generation_prompt=False
    )
    closed = tokenize(server, messages=turns, add_generation_prompt=False)
    assert continued != closed and len(continued) < len(closed)
    # continuing needs no generation prompt: left out, it is dropped; given true, a 400
    assert tokenize(server, messages=turns, continue_final_message=True) == continued
    for path in ("/tokenize", "/v1/chat/completions"):
        both = {"messages": turns, "continue_final_message": True, "add_generation_prompt": True}
        status, reply = http(server, path, both)
        assert status == 400 and reply["error"]["param"] == "continue_final_message", reply
    status, reply = http(server, "/tokenize", {"messages": []})
    assert status == 400 and reply["error"]["param"] == "messages"


def test_continuous_usage_stats_count_each_choice_so_far(api: openai.OpenAI) -> None:
    """vLLM's ``continuous_usage_stats``: with ``include_usage``, every chunk carries its
    choice's usage so far (its own prompt's tokens, its tokens up to this chunk)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"ignore_eos": True, "return_token_ids": True}
    prompts = [[5, 6, 7], [8, 9]]
    chunks = list(
        api.completions.create(
            model="tiny",
            prompt=prompts,
            max_tokens=4,
            n=2,
            stream=True,
            stream_options=options,
            extra_body=extra,
        )
    )
    so_far: Counter[int] = Counter()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        so_far[choice.index] += len(choice.model_extra["token_ids"])
        num_prompt = len(prompts[choice.index // 2])
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
            num_prompt,
            so_far[choice.index],
        )
        assert chunk.usage.total_tokens == num_prompt + so_far[choice.index]
    assert so_far == dict.fromkeys(range(4), 4)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == 3 + 2  # each prompt once, as vLLM counts

    messages = [{"role": "user", "content": "hi"}]
    stream = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, stream=True, stream_options=options
    )
    chat = list(stream)
    num_prompt = chat[-1].usage.prompt_tokens
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[0].usage.completion_tokens == 0 and chat[0].usage.prompt_tokens == num_prompt
    counts = [c.usage.completion_tokens for c in chat[1:-1]]
    assert counts == sorted(counts) and counts[-1] == chat[-1].usage.completion_tokens
    # Without continuous_usage_stats only the last chunk has usage.
    plain = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert [c.usage is not None for c in plain][-2:] == [False, True]


def test_chat_streaming_n(api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    whole = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    stream = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    roles = []
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
    assert sorted(roles) == [0, 1]
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage.completion_tokens == 10


# -- errors ------------------------------------------------------------------------------------


def test_bad_parameters_name_the_field(api: openai.OpenAI, server: Served) -> None:
    cases = [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 2, "extra_body": {"min_tokens": 5}}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [-3]}}, "stop_token_ids"),
        ({"logprobs": 99}, "logprobs"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as error:
            api.completions.create(model="tiny", prompt="x", **kwargs)
        assert error.value.body["param"] == field, (kwargs, error.value.body)
        assert error.value.body["type"] == "invalid_request_error"
    status, reply = http(server, "/v1/completions", {"prompt": "x", "temperature": "hot"})
    assert status == 400 and reply["error"]["param"] == "temperature"
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for path, body, field in [
        ("/v1/completions", {"prompt": "\ud800"}, "prompt"),  # a lone surrogate (was a 500)
        ("/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
        (
            "/v1/completions",
            {"prompt": "x", "use_beam_search": True, "length_penalty": float("nan")},
            "length_penalty",
        ),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stop": "y"}, "stop"),
        # A text longer than the context can hold in any tokenization: refused untokenized.
        ("/v1/completions", {"prompt": "x" * 100_000}, "prompt"),
        ("/tokenize", {"prompt": "x" * 100_000}, "prompt"),
        ("/detokenize", {"tokens": [1] * 5000}, "tokens"),  # more than max_model_len (4096)
        # A message with a role no template knows, or without the content its role needs.
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0"),
        ("/v1/chat/completions", {"messages": [*chat["messages"], {"role": "user"}]}, "messages.1"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": None}, *chat["messages"]]},
            "messages.0",
        ),
    ]:
        status, reply = http(server, path, body)
        assert status == 400 and reply["error"]["param"].startswith(field), (body, reply)
    # The field the request sent, where the engine calls it otherwise; options that need
    # another one refused as vLLM does.
    for path, body, field in [
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "stream_options": {}}, "stream_options"),
        ("/v1/chat/completions", {**chat, "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/v1/completions", {"prompt": "x", "stream_options": {}}, "stream_options"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": 99}, "best_of"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 99}, "n"),
    ]:
        status, reply = http(server, path, body)
        assert status == 400 and reply["error"]["param"] == field, (body, reply)
        assert field in reply["error"]["message"], reply
    status, reply = http(server, "/v1/completions", {"prompt": [9_999_999]})
    assert status == 400 and "vocabulary" in reply["error"]["message"]
    status, reply = http(server, "/v1/completions", {"prompt": [1] * 5000})
    assert status == 400 and "max_model_len" in reply["error"]["message"]
    status, reply = http(server, "/v1/completions", {"prompt": []})
    assert status == 400 and reply["error"]["param"] == "prompt"
    # Integers beyond what the engine's frames carry: 400s naming the field, not 500s.
    for body, field in [
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": [2**31]}, "prompt"),
        ({"prompt": [[5], [10**20]]}, "prompt"),
    ]:
        status, reply = http(server, "/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == field, (body, reply)
    # One bad prompt of several is a 400 before anything streams, not an error mid-stream,
    # and a refused request counts in no finish reason (it never ran).
    aborts = ("mpengine:request_success_total", (("finished_reason", "abort"),))
    before = _metrics(server).get(aborts, 0.0)
    for stream in (False, True):
        body = {"prompt": [[5, 6], [5, 9_999_999]], "max_tokens": 2, "stream": stream}
        status, reply = http(server, "/v1/completions", body)
        assert status == 400, reply
        assert reply["error"]["message"].startswith("prompt[1]: token id 9999999")
        assert reply["error"]["type"] == "invalid_request_error"
    body = {"prompt": "x", "stop_token_ids": [9_999_999]}  # refused by the engine itself
    status, reply = http(server, "/v1/completions", body)
    assert status == 400 and "stop_token_ids" in reply["error"]["message"], reply
    assert _metrics(server).get(aborts, 0.0) == before
    raw = urllib.request.Request(server.url + "/v1/completions", data=b"not json")
    raw.add_header("Content-Type", "application/json")
    raw.add_header("Authorization", f"Bearer {KEY}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(raw, timeout=REQUEST_TIMEOUT_S)
    reply = json.loads(refused.value.read())
    assert refused.value.code == 400 and reply["error"]["param"] is None
    assert reply["error"]["message"].startswith("the body is not valid JSON")
    # max_tokens past the context is refused, not cut short (4096 - 3 tokens are left)
    with pytest.raises(openai.BadRequestError) as error:
        api.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4094)
    assert error.value.body["param"] == "max_tokens"
    assert "at most 4093 can be generated" in error.value.body["message"]
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5000)
    assert error.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert error.value.body["param"] == "messages"
    # An assistant turn without content (it called tools) is replayed as OpenAI allows.
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "more"},
    ]
    reply = api.chat.completions.create(model="tiny", messages=history, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_too_large_body_is_413(server: Served) -> None:
    # 64 KiB frames (--max-request-bytes) allow bodies of 256 KiB.
    status, reply = http(server, "/v1/completions", {"prompt": "x" * 300_000})
    assert status == 413 and reply["error"]["code"] == "request_too_large"


def test_overloaded_is_503_and_the_engine_recovers(api: openai.OpenAI, server: Served, ipc) -> None:
    """8 running and 16 sequences waiting at most, one tenant (a ``user``, else one HTTP
    request) holding half of the queue: with a user's requests running and its half
    waiting, its next request is refused with 503 and ``Retry-After``; another user is
    still served beside it (fair shares); a request of more prompts than one tenant may
    ever queue is a 400 (a retry would never succeed)."""
    wait_idle(ipc, timeout=30)
    body = {"prompt": [[1, 2, 3]] * 4, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    body["user"] = "hog"
    held: list[socket.socket] = []
    try:
        held += [_raw_post(server, body), _raw_post(server, body)]
        wait_stats(ipc, lambda s: s.num_running == 8)
        held += [_raw_post(server, body), _raw_post(server, body)]
        wait_stats(ipc, lambda s: s.num_waiting == 8)
        with pytest.raises(openai.APIStatusError) as error:
            openai.OpenAI(base_url=api.base_url, api_key=KEY, max_retries=0).completions.create(
                model="tiny", prompt=[[1, 2, 3]], max_tokens=2, user="hog"
            )
        assert error.value.status_code == 503
        assert error.value.body["code"] == "overloaded"
        assert "of this tenant" in error.value.body["message"]
        assert error.value.response.headers["Retry-After"] == "1"  # when to try again
        # Refused prompts of a request of several count in no finish reason: none ran.
        aborts = ("mpengine:request_success_total", (("finished_reason", "abort"),))
        before = _metrics(server).get(aborts, 0.0)
        more = {"prompt": [[1, 2]] * 3, "max_tokens": 2, "user": "hog"}
        status, reply = http(server, "/v1/completions", more)
        assert status == 503 and reply["error"]["code"] == "overloaded", reply
        assert _metrics(server).get(aborts, 0.0) == before
        other = api.completions.create(model="tiny", prompt=[[1, 2, 3]], max_tokens=2)
        assert other.choices[0].finish_reason == "length"
        assert ipc.stats().fair_preemptions >= 1  # a sequence of the hog's gave way
        status, reply = http(server, "/v1/completions", {"prompt": [[1, 2]] * 9, "max_tokens": 2})
        assert status == 400 and "half of max_waiting_requests=16" in reply["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    stats = wait_idle(ipc, timeout=30)
    assert stats.num_free_blocks == stats.num_blocks


def test_one_request_cannot_hold_the_engine(api: openai.OpenAI, server: Served, ipc) -> None:
    """A request whose samples take every seat for thousands of steps (one prompt, n=8,
    3,000 tokens each) no longer makes another client's small request wait for it: that
    one is served while the big one streams on (it waited 38 s before, at 4,000 prompts x
    n=64: such a request is now a 400)."""
    wait_idle(ipc, timeout=30)
    body = {"prompt": [1, 2, 3], "n": 8, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    hog = _raw_post(server, body)
    try:
        wait_stats(ipc, lambda s: s.num_running == 8)
        small = api.completions.create(model="tiny", prompt=[[4, 5, 6, 7]], max_tokens=4)
        assert small.choices[0].finish_reason == "length"
        stats = ipc.stats()
        assert stats.num_running + stats.num_preempted == 8  # the big one goes on
        assert stats.fair_preemptions >= 1
    finally:
        hog.close()
    huge = {"prompt": [[1, 2, 3]] * 4000, "n": 8, "max_tokens": 3000, "stream": True}
    status, reply = http(server, "/v1/completions", huge)
    assert status == 400 and "4000 prompts of 8 samples" in reply["error"]["message"], reply
    wait_idle(ipc, timeout=30)


def _raw_post(server: Served, body: dict, path: str = "/v1/completions") -> socket.socket:
    """Send a request on a socket of its own (to close mid-request); returns the socket."""
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def wait_stats(ipc: mpengine.Client, ready: Callable[[EngineStats], bool], timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready(stats := ipc.stats()):
        assert time.monotonic() < deadline, f"the engine never got there: {stats}"
        time.sleep(0.01)


def _wait_running(ipc: mpengine.Client) -> None:
    wait_stats(ipc, lambda s: s.num_running > 0)


def test_a_stream_nobody_reads_is_aborted(server: Served, ipc) -> None:
    """A client that asked for a long stream and never read it held its outputs in the
    server (7.7 MB a stream) until its socket closed: once a write waits the stall timeout,
    the stream ends and its request is aborted."""
    wait_idle(ipc, timeout=30)
    before = ipc.stats().aborted
    body = {"prompt": "Once upon", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    body |= {"logprobs": 20, "n": 4}  # large chunks: the socket buffers fill in seconds
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting)
    try:
        sock.connect((host, int(port)))
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        wait_stats(ipc, lambda s: s.aborted > before, timeout=60 + STALL_S)
        stats = wait_idle(ipc, timeout=30)
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server: Served, ipc, stream: bool) -> None:
    before = wait_idle(ipc, timeout=30)
    body = {"prompt": "Tell me", "max_tokens": 3000, "stream": stream, "ignore_eos": True}
    sock = _raw_post(server, body)
    try:
        if stream:
            received = b""
            while b"data:" not in received:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the stream"
                received += chunk
        else:
            _wait_running(ipc)
    finally:
        sock.close()
    stats = wait_idle(ipc, timeout=30)
    assert stats.aborted == before.aborted + 1
    assert stats.num_free_blocks == stats.num_blocks


def test_cors_lets_a_browser_page_call_the_api(server: Served) -> None:
    """vLLM's default: any origin. A preflight is answered without the API key."""
    origin = "http://ui.example"
    preflight = urllib.request.Request(server.url + "/v1/completions", method="OPTIONS")
    preflight.add_header("Origin", origin)
    preflight.add_header("Access-Control-Request-Method", "POST")
    preflight.add_header("Access-Control-Request-Headers", "authorization, content-type")
    with urllib.request.urlopen(preflight, timeout=REQUEST_TIMEOUT_S) as reply:
        assert reply.status == 200
        assert reply.headers["access-control-allow-origin"] in ("*", origin)
        assert "POST" in reply.headers["access-control-allow-methods"]
    request = urllib.request.Request(server.url + "/health", headers={"Origin": origin})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        assert reply.headers["access-control-allow-origin"] == "*"


def test_cors_flags_take_json_lists() -> None:
    from mpengine.server.options import json_list

    assert json_list('["http://a.example", "https://b.example"]') == [
        "http://a.example",
        "https://b.example",
    ]
    for bad in ("http://a.example", '"*"', "[1]"):
        with pytest.raises(argparse.ArgumentTypeError, match="JSON list"):
            json_list(bad)


# -- tokenizer endpoints and metrics -----------------------------------------------------------


def test_tokenize_round_trip(server: Served) -> None:
    status, reply = http(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and reply["count"] == len(reply["tokens"]) == len(reply["token_strs"])
    # The vocabulary's spellings, as vLLM returns them (a byte-level BPE marks spaces "Ġ").
    assert "".join(reply["token_strs"]) == "HelloĠworld" and reply["max_model_len"] == 4096
    status, refused = http(server, "/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"})
    assert status == 400 and refused["error"]["param"] == "chat_template"
    assert http(server, "/detokenize", {"tokens": reply["tokens"]}) == (
        200,
        {"prompt": "Hello world"},
    )
    status, reply = http(server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and reply["error"]["param"] == "tokens"


def _metrics(server: Served) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S) as reply:
        text = reply.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            own = ("model_name", "engine")
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in own))
            if family.name.startswith("mpengine:") and not sample.name.endswith("_created"):
                assert sample.labels["model_name"] == NAMES[0]
                assert sample.labels["engine"] == "0"  # (one engine: replica 0)
                values[sample.name, labels] = sample.value
    return values


def _http_counts(server: Served) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S) as reply:
        text = reply.read().decode()
    return {
        (s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "http_requests"
        for s in family.samples
        if s.name == "http_requests_total"
    }


def test_http_answers_are_counted_by_handler_and_status(server: Served) -> None:
    """Refused requests showed in no metric (vLLM counts every answer by status class)."""
    before = _http_counts(server)
    assert http(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    assert http(server, "/v1/completions", {"prompt": "x", "max_tokens": -1})[0] == 400
    assert http(server, "/v1/completions", {"prompt": "x"}, key="wrong")[0] == 401
    assert http(server, "/no/such/path")[0] == 404
    assert http(server, f"/v1/models/{NAMES[0]}")[0] == 200
    after = _http_counts(server)

    def delta(*key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("/v1/completions", "POST", "2xx") == 1
    assert delta("/v1/completions", "POST", "4xx") == 2
    assert delta("none", "GET", "4xx") == 1
    assert delta("/v1/models/{name}", "GET", "2xx") == 1


def test_metrics_count_a_known_workload_exactly(server: Served, api: openai.OpenAI, ipc) -> None:
    ids = tokenize(server, prompt="alpha beta")
    stop_id = greedy(ipc, ids, 3)[2]
    wait_idle(ipc, timeout=30)
    before = _metrics(server)
    # 7 engine requests: a completion, a chat, a greedy completion that stops on a token,
    # best_of, beam search, and a streamed one of 2 prompts with n=2.
    extra = {"ignore_eos": True}
    replies = [
        api.completions.create(model="tiny", prompt="alpha beta", max_tokens=5, extra_body=extra),
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            extra_body=extra,
        ),
        api.completions.create(
            model="tiny",
            prompt="alpha beta",
            max_tokens=8,
            temperature=0,
            extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
        ),
    ]
    assert replies[2].choices[0].finish_reason == "stop"
    # Ranked requests arrive whole, one output per returned sample; each is one request,
    # and best_of's usage (and the token counter) counts the samples not returned too.
    ranked = [
        api.completions.create(
            model="tiny", prompt="alpha", n=2, best_of=3, max_tokens=4, extra_body=extra
        ),
        api.completions.create(
            model="tiny",
            prompt="beta",
            n=2,
            max_tokens=4,
            extra_body={"use_beam_search": True, "ignore_eos": True},
        ),
    ]
    assert ranked[0].usage.completion_tokens == 12
    chunks = list(
        api.completions.create(
            model="tiny",
            prompt=["one", "two"],
            n=2,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    streamed = chunks[-1].usage
    finals = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    reasons = Counter(finals + [c.finish_reason for r in replies + ranked for c in r.choices])
    num_requests = 7
    num_samples = sum(reasons.values())
    num_prompt = sum(r.usage.prompt_tokens for r in replies + ranked) + streamed.prompt_tokens
    num_generated = (
        sum(r.usage.completion_tokens for r in replies + ranked) + streamed.completion_tokens
    )
    num_ranked_tokens = sum(r.usage.completion_tokens for r in ranked)
    after = _metrics(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("mpengine:prompt_tokens_total") == num_prompt
    assert delta("mpengine:generation_tokens_total") == num_generated
    for reason, count in reasons.items():
        assert delta("mpengine:request_success_total", finished_reason=reason) == count
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(f"mpengine:{histogram}_count") == num_requests, histogram
    assert delta("mpengine:request_prompt_tokens_sum") == num_prompt
    assert delta("mpengine:request_generation_tokens_sum") == num_generated
    # One output per token per sample: a sample's gaps are its tokens but one; a ranked
    # sample has no gaps (it arrives whole).
    gaps = num_generated - num_ranked_tokens - (num_samples - 4)
    assert delta("mpengine:inter_token_latency_seconds_count") == gaps
    stats = ipc.stats()
    assert after["mpengine:num_preemptions_total", ()] == stats.preemptions
    assert after["mpengine:num_requests_running", ()] == 0
    assert after["mpengine:kv_cache_usage_perc", ()] == 0.0
    assert after["mpengine:steps_total", ()] == stats.done
    stages = {dict(k[1])["stage"] for k in after if k[0] == "mpengine:stage_busy_seconds_total"}
    assert stages == {"scheduler", "executor", "output"}
    assert after["mpengine:iteration_tokens_total_count", ()] == stats.step
    assert after["mpengine:iteration_tokens_total_sum", ()] == stats.computed_tokens
    (info,) = [dict(k[1]) for k in after if k[0] == "mpengine:cache_config_info"]
    assert info["block_size"] == str(ipc.info.block_size)
    assert info["num_gpu_blocks"] == str(ipc.info.num_blocks)
    assert info["enable_prefix_caching"] == "True"


def test_engine_file_names_the_http_address(server: Served) -> None:
    directory = server.address.removeprefix("ipc://").rsplit("/", 1)[0]
    record = json.loads(Path(directory, "engine.json").read_text())
    assert record["http"] == server.url
    assert set(record["stages"]) == {"scheduler", "executor", "output"}
    assert all(os.path.exists(f"/proc/{pid}") for pid in record["stages"].values())
