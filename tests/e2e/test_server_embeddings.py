"""``POST /v1/embeddings``, driven by the official ``openai`` package.

One ``mpengine serve --model tiny-bert`` for the module (an encoder: mean pooling, then L2
normalisation, and no generation). Its embeddings must equal a plain transformers
reference: ``AutoModel``'s last hidden states, averaged over the attention mask of a padded
batch, normalised. A generation model (``tiny``) answers embeddings with 400.
"""

from __future__ import annotations

import base64
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from mpengine.models.resolve import resolve_model
from mpengine.protocol import PoolingParams
from mpengine.server.embeddings import encode
from mpengine.server.schemas import EmbeddingRequest
from tests.e2e.test_server import KEY, REQUEST_TIMEOUT_S, _raw_post, http
from tests.e2e.test_server_cli import Served, serving

MODEL = "tiny-bert"
HIDDEN_SIZE = 64
MAX_MODEL_LEN = 512
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "A", "Once upon a time"]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve-embed")
    flags = ["--model", MODEL, "--api-key", KEY]
    flags += ["--max-num-seqs", "8", "--max-waiting-requests", "8"]
    flags += ["--max-request-bytes", "65536"]
    with serving(root, *flags) as served:
        yield served
    assert served.proc.returncode == 0, served.log()


@pytest.fixture(scope="module")
def api(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, timeout=REQUEST_TIMEOUT_S)


class Reference:
    """tiny-bert through transformers: mean pooling over the attention mask of a padded
    batch (sentence-transformers' way), before and after L2 normalisation."""

    def __init__(self) -> None:
        import torch
        import transformers

        path = resolve_model(MODEL)
        self.torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModel.from_pretrained(path).eval()

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def pooled(self, texts: list[str]) -> np.ndarray:
        torch = self.torch
        batch = self.tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return ((hidden * mask).sum(1) / mask.sum(1)).numpy()

    def embed(self, texts: list[str]) -> np.ndarray:
        pooled = self.pooled(texts)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def cosine(a: object, b: object) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def vectors(reply: object) -> list[list[float]]:
    assert [d.index for d in reply.data] == list(range(len(reply.data)))
    assert all(d.object == "embedding" for d in reply.data)
    return [d.embedding for d in reply.data]


# -- without an engine ------------------------------------------------------------------------


def test_request_maps_onto_pooling_params() -> None:
    assert EmbeddingRequest(input="x").pooling_params() == PoolingParams()
    body = EmbeddingRequest(
        input=["a"], dimensions=8, normalize=False, pooling="cls", truncate_prompt_tokens=-1
    )
    assert body.pooling_params() == PoolingParams("cls", False, 8, -1)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        EmbeddingRequest(input="x", truncate_prompt_tokens=0).pooling_params()


def test_base64_is_little_endian_float32() -> None:
    vector = np.array([0.5, -1.25, 3e-8], dtype=np.float32)
    assert encode(vector, "float") == vector.tolist()
    raw = base64.b64decode(encode(vector, "base64"))
    assert raw == vector.astype("<f4").tobytes() and len(raw) == 12


# -- embeddings --------------------------------------------------------------------------------


def test_embeddings_equal_transformers(api: openai.OpenAI, reference: Reference) -> None:
    assert [m.id for m in api.models.list().data] == [MODEL]
    reply = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == MODEL
    expected = reference.embed(TEXTS)
    got = vectors(reply)
    for text, vector, want in zip(TEXTS, got, expected, strict=True):
        assert len(vector) == HIDDEN_SIZE
        assert cosine(vector, want) >= MIN_COSINE, text
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    num_tokens = sum(len(reference.ids(t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == num_tokens


def test_base64_and_the_default_format(api: openai.OpenAI, server: Served) -> None:
    floats = vectors(api.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float"))
    # Without encoding_format the openai package asks for base64 and decodes it.
    assert np.allclose(vectors(api.embeddings.create(model=MODEL, input=TEXTS[:2])), floats)
    status, reply = http(
        server, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"}
    )
    assert status == 200, reply
    for item, want in zip(reply["data"], floats, strict=True):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        # float32 little-endian; values as the float reply's up to batching noise (the two
        # requests may share steps with different companions)
        assert decoded.dtype == np.float32 and len(decoded) == HIDDEN_SIZE
        assert decoded.tolist() == pytest.approx(want, abs=1e-5)


def test_token_ids_equal_text(api: openai.OpenAI, reference: Reference) -> None:
    ids = [reference.ids(t) for t in TEXTS[:2]]
    by_text = vectors(api.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float"))
    by_ids = vectors(api.embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    single = vectors(api.embeddings.create(model=MODEL, input=ids[0], encoding_format="float"))
    assert np.allclose(by_ids, by_text, atol=1e-6)
    assert np.allclose(single[0], by_text[0], atol=1e-6)


def test_add_special_tokens_false_embeds_the_text_alone(
    api: openai.OpenAI, reference: Reference
) -> None:
    """vLLM's ``add_special_tokens``: false embeds text without [CLS] and [SEP]."""
    bare = [reference.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:2]]
    reply = api.embeddings.create(
        model=MODEL,
        input=TEXTS[:2],
        encoding_format="float",
        extra_body={"add_special_tokens": False},
    )
    want = vectors(api.embeddings.create(model=MODEL, input=bare, encoding_format="float"))
    assert np.allclose(vectors(reply), want, atol=1e-6)
    assert reply.usage.prompt_tokens == sum(map(len, bare))


def test_dimensions_and_normalize(api: openai.OpenAI, reference: Reference) -> None:
    pooled = reference.pooled(TEXTS[:2])
    reply = api.embeddings.create(model=MODEL, input=TEXTS[:2], dimensions=16)
    for vector, want in zip(vectors(reply), pooled, strict=True):
        assert len(vector) == 16  # the first 16 values, normalised again (Matryoshka)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        assert cosine(vector, want[:16]) >= MIN_COSINE
    raw = api.embeddings.create(
        model=MODEL, input=TEXTS[:2], encoding_format="float", extra_body={"normalize": False}
    )
    for vector, want in zip(vectors(raw), pooled, strict=True):
        assert cosine(vector, want) >= MIN_COSINE
        assert np.linalg.norm(vector) == pytest.approx(np.linalg.norm(want), rel=1e-3)
        assert abs(np.linalg.norm(vector) - 1.0) > 0.01


def test_truncate_prompt_tokens(api: openai.OpenAI, reference: Reference) -> None:
    long_ids = [5 + i % 200 for i in range(MAX_MODEL_LEN + 88)]

    def embed(prompt: object, **extra: object) -> tuple[list[float], int]:
        reply = api.embeddings.create(
            model=MODEL, input=prompt, encoding_format="float", extra_body=extra
        )
        return reply.data[0].embedding, reply.usage.prompt_tokens

    # Token ids: the first K are kept; -1 keeps max_model_len of them.
    vector, num_tokens = embed(long_ids, truncate_prompt_tokens=16)
    assert num_tokens == 16 and np.allclose(vector, embed(long_ids[:16])[0], atol=1e-6)
    assert embed(long_ids, truncate_prompt_tokens=-1)[1] == MAX_MODEL_LEN
    # Text: truncated as transformers' truncation=True does, the special tokens kept.
    text = TEXTS[1]
    ids = reference.tokenizer(text, truncation=True, max_length=6)["input_ids"]
    vector, num_tokens = embed(text, truncate_prompt_tokens=6)
    assert num_tokens == 6 and np.allclose(vector, embed(ids)[0], atol=1e-6)
    assert embed(text, truncate_prompt_tokens=100)[1] == len(reference.ids(text))


# -- errors ------------------------------------------------------------------------------------


def test_bad_requests_are_400_naming_the_field(server: Served, api: openai.OpenAI) -> None:
    cases = [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": "   "}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": "x", "dimensions": HIDDEN_SIZE + 1}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "pooling": "max"}, "pooling"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": [10**9]}, "input"),
        ({"input": {"text": "x"}}, "input"),
    ]
    for body, field in cases:
        status, reply = http(server, "/v1/embeddings", body)
        assert status == 400, (body, reply)
        assert reply["error"]["param"] == field, (body, reply)
        assert reply["error"]["type"] == "invalid_request_error"
    assert api.embeddings.create(model=MODEL, input="still serving").data


def test_too_long_input_is_400(server: Served, api: openai.OpenAI) -> None:
    body = {"input": [[5] * (MAX_MODEL_LEN + 1)]}
    status, reply = http(server, "/v1/embeddings", body)
    assert status == 400 and reply["error"]["param"] == "input", reply
    assert "truncate_prompt_tokens" in reply["error"]["message"]
    assert api.embeddings.create(model=MODEL, input="still serving").data


def test_generation_on_an_embedding_model_is_400(server: Served, api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        api.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert error.value.body["param"] == "model"
    assert "/v1/embeddings" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["param"] == "model"
    assert http(server, "/tokenize", {"prompt": "Hello world"})[0] == 200
    assert api.embeddings.create(model=MODEL, input="still serving").data


def test_model_key_and_size_errors(server: Served, api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        api.embeddings.create(model="text-embedding-3-small", input="x")
    assert error.value.body["param"] == "model"
    status, reply = http(server, "/v1/embeddings", {"input": "x"}, key=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    # 64 KiB frames (--max-request-bytes) allow bodies of 256 KiB.
    status, reply = http(server, "/v1/embeddings", {"input": "x" * 300_000})
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    # 8 waiting at most: 40 inputs are fed as earlier ones finish, not refused.
    inputs = [[5, 6, 7 + i % 3] for i in range(40)]
    many = vectors(api.embeddings.create(model=MODEL, input=inputs))
    few = vectors(api.embeddings.create(model=MODEL, input=inputs[:3]))
    np.testing.assert_allclose(many[:3], few, atol=1e-5)
    assert len(many) == 40


def test_embeddings_count_in_the_metrics(server: Served, api: openai.OpenAI) -> None:
    def prompt_tokens() -> float:
        status, text = _get(server, "/metrics")
        assert status == 200
        line = next(x for x in text.splitlines() if x.startswith("mpengine:prompt_tokens_total"))
        return float(line.rsplit(" ", 1)[1])

    before = prompt_tokens()
    reply = api.embeddings.create(model=MODEL, input=TEXTS)
    assert prompt_tokens() - before == reply.usage.prompt_tokens


def test_an_abandoned_request_counts_its_unfinished_inputs_as_aborted(server: Served) -> None:
    """Each input counts as it finishes (``stop``); when the client goes away, the inputs
    not finished then count as aborted. Every input counted as aborted before, the
    finished ones too."""
    before = {reason: _successes(server, reason) for reason in ("stop", "abort")}
    body = {"model": MODEL, "input": [[5, 6, 7, 8] * 8] * 2000}  # 80 kB, seconds of work
    sock = _raw_post(server, body, "/v1/embeddings")
    deadline = time.monotonic() + 30
    while _successes(server, "stop") == before["stop"]:  # (polls: no sleep decides anything)
        assert time.monotonic() < deadline, "no input finished"
        time.sleep(0.02)
    sock.close()
    while True:
        done = {reason: _successes(server, reason) - before[reason] for reason in before}
        if done["stop"] + done["abort"] == 2000:
            break
        assert time.monotonic() < deadline, done
        time.sleep(0.05)
    assert done["stop"] > 0 and done["abort"] > 0, done


def _successes(server: Served, reason: str) -> float:
    status, text = _get(server, "/metrics")
    assert status == 200
    prefix = f'mpengine:request_success_total{{engine="0",finished_reason="{reason}"'
    lines = [x for x in text.splitlines() if x.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def _get(server: Served, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(server.url + path, timeout=REQUEST_TIMEOUT_S) as reply:
        return reply.status, reply.read().decode()


def test_embeddings_on_a_generation_model_is_400(tmp_path: Path) -> None:
    with serving(tmp_path, "--model", "tiny", "--api-key", KEY) as served:
        status, reply = http(served, "/v1/embeddings", {"input": "Hello"})
        assert status == 400, reply
        assert reply["error"]["param"] == "model" and "cannot embed" in reply["error"]["message"]
        api = openai.OpenAI(base_url=served.base_url, api_key=KEY, timeout=REQUEST_TIMEOUT_S)
        assert api.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices
        assert served.stop() == 0
