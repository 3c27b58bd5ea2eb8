"""Embeddings through the three stages, against plain transformers, on the built-in models.

``tiny-bert`` is an encoder (mean pooling, whole prompts, no KV cache); ``tiny-embed`` a
Qwen3-style causal LM that declares last-token pooling (paged path, prompts chunked, and
it generates too). References: ``AutoModel``'s last hidden state, pooled and normalised.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModel

import mpengine
from mpengine import AsyncClient, InvalidRequestError, PoolingParams, SamplingParams
from mpengine.models.resolve import resolve_model

TIMEOUT = 120.0
TEXTS = [
    "hello world",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 6,  # chunked at a 64-token budget
    "x y z " * 45,
    "Numbers 12345 and punctuation!?; emoji \U0001f600 and accents: café, naïve.",
]


def reference(model_name: str, ids: list[int], pooling: str, normalize: bool = True):
    path = resolve_model(model_name)
    model = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    vector = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.numpy()


def tokenize(model_name: str, text: str) -> list[int]:
    return Tokenizer.from_file(f"{resolve_model(model_name)}/tokenizer.json").encode(text).ids


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    cosine = float(np.dot(actual, expected) / np.linalg.norm(actual) / np.linalg.norm(expected))
    assert cosine >= 0.99999, cosine
    np.testing.assert_allclose(actual, expected, atol=2e-5)


@pytest.fixture(scope="module")
def bert_engine(start_engine):
    return start_engine(model="tiny-bert")


@pytest.fixture(scope="module")
def bert(bert_engine):
    return bert_engine.client(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def decoder_engine(start_engine):
    # A small budget: the longer prompts are pooled across chunks of several steps.
    return start_engine(model="tiny-embed", max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def decoder(decoder_engine):
    return decoder_engine.client(timeout=TIMEOUT)


def test_encoder_matches_transformers(bert):
    info = bert.info
    assert info.pooling is not None and info.pooling.is_encoder
    assert (info.pooling.pooling, info.pooling.normalize, info.can_generate) == (
        "mean",
        True,
        False,
    )
    outs = bert.embed_many(TEXTS, timeout=TIMEOUT)
    for text, out in zip(TEXTS, outs, strict=True):
        ids = tokenize("tiny-bert", text)
        assert out.prompt_token_ids == ids and out.num_prompt_tokens == len(ids)
        assert out.embedding.dtype == np.float32 and out.embedding.shape == (64,)
        assert_close(out.embedding, reference("tiny-bert", ids, "mean"))
    # Per-request overrides: CLS pooling, no normalisation, token ids in.
    ids = tokenize("tiny-bert", TEXTS[0])
    raw = bert.embed(ids, PoolingParams(pooling="cls", normalize=False), timeout=TIMEOUT)
    assert_close(raw.embedding, reference("tiny-bert", ids, "cls", normalize=False))


def test_decoder_pools_across_chunks(decoder):
    info = decoder.info
    assert info.pooling is not None and not info.pooling.is_encoder
    assert (info.pooling.pooling, info.can_generate) == ("last", True)
    for pooling in ("last", "mean"):
        outs = decoder.embed_many(TEXTS, PoolingParams(pooling=pooling), timeout=TIMEOUT)
        for text, out in zip(TEXTS, outs, strict=True):
            ids = tokenize("tiny-embed", text)
            assert out.prompt_token_ids == ids
            assert_close(out.embedding, reference("tiny-embed", ids, pooling))
    assert len(tokenize("tiny-embed", TEXTS[2])) > 64  # it was chunked


def test_embed_many_reports_each_input_as_it_finishes(bert_engine, bert):
    """``on_output(index, embedding)`` once per input (sync and asyncio clients), with the
    embedding the call returns for that index."""
    for run in ("sync", "async"):
        seen: dict[int, np.ndarray] = {}

        def on_output(index, out, seen=seen):
            assert index not in seen
            seen[index] = out.embedding

        if run == "sync":
            outs = bert.embed_many(TEXTS, timeout=TIMEOUT, on_output=on_output)
        else:

            async def embed_all(on_output=on_output):
                client = AsyncClient(bert_engine.address, timeout=TIMEOUT)
                try:
                    return await client.embed_many(TEXTS, timeout=TIMEOUT, on_output=on_output)
                finally:
                    client.close()

            outs = asyncio.run(embed_all())
        assert sorted(seen) == list(range(len(TEXTS))), run
        for index, out in enumerate(outs):
            np.testing.assert_array_equal(seen[index], out.embedding)


def test_matryoshka_dimensions_renormalise(bert):
    full = bert.embed(TEXTS[4], PoolingParams(normalize=False), timeout=TIMEOUT).embedding
    cut = bert.embed(TEXTS[4], PoolingParams(dimensions=16), timeout=TIMEOUT).embedding
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


def test_embeddings_and_generation_share_steps(decoder_engine, decoder):
    """Generation and pooling requests admitted together run in the same steps (a 64-token
    budget, prompts of ~80 tokens), and each gets what it would get alone."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = decoder.generate(TEXTS[2], params, timeout=TIMEOUT).token_ids
    expected = decoder.embed(TEXTS[3], timeout=TIMEOUT).embedding

    async def both():
        client = AsyncClient(decoder_engine.address, timeout=TIMEOUT)
        try:
            return await asyncio.gather(
                client.generate(TEXTS[2], params, timeout=TIMEOUT),
                client.embed_many([TEXTS[3]] * 3, timeout=TIMEOUT),
                client.embed(TEXTS[0], timeout=TIMEOUT),
            )
        finally:
            client.close()

    before = decoder.stats().step
    generated, embedded, single = asyncio.run(both())
    assert generated.token_ids == alone
    for out in embedded:
        np.testing.assert_allclose(out.embedding, expected, atol=1e-6)
    assert_close(
        single.embedding, reference("tiny-embed", tokenize("tiny-embed", TEXTS[0]), "last")
    )
    stats = decoder.stats()
    # 4 embedding prompts + a 12-token generation in far fewer steps than one at a time.
    assert stats.step - before < 12 + 4 * 3
    # Every block is free again (cached prompt blocks count as free: evictable).
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_truncation(bert):
    long = "word " * 400  # ~400 tokens; tiny-bert takes 512 positions at most
    limit = bert.info.max_model_len
    with pytest.raises(InvalidRequestError, match="at most"):
        bert.embed("word " * (limit + 10), timeout=TIMEOUT)
    out = bert.embed(long, PoolingParams(truncate_prompt_tokens=32), timeout=TIMEOUT)
    ids = tokenize("tiny-bert", long)
    assert out.num_prompt_tokens == 32
    # Text keeps the tokenizer's framing ([CLS] ... [SEP]), as transformers' truncation does.
    assert out.prompt_token_ids[0] == ids[0] and out.prompt_token_ids[-1] == ids[-1]
    assert_close(out.embedding, reference("tiny-bert", out.prompt_token_ids, "mean"))
    # A limit beyond the model's is the model's: the text keeps its framing ([SEP] was cut).
    over = "word " * (limit + 10)
    beyond = bert.embed(over, PoolingParams(truncate_prompt_tokens=limit + 50), timeout=TIMEOUT)
    whole = bert.embed(over, PoolingParams(truncate_prompt_tokens=-1), timeout=TIMEOUT)
    assert beyond.prompt_token_ids == whole.prompt_token_ids
    assert len(whole.prompt_token_ids) == limit and whole.prompt_token_ids[-1] == ids[-1]
    # Token ids are cut to their first K.
    cut = bert.embed(ids, PoolingParams(truncate_prompt_tokens=20), timeout=TIMEOUT)
    assert cut.prompt_token_ids == ids[:20]
    assert_close(cut.embedding, reference("tiny-bert", ids[:20], "mean"))


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("   ", None, "empty"),
        ([], None, "empty"),
        ("hi", PoolingParams(dimensions=65), "exceeds the model's embedding size"),
        ([10**6], None, "outside the vocabulary"),
    ],
)
def test_bad_embedding_requests_fail_alone(bert, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        bert.embed(prompt, params, timeout=TIMEOUT)
    assert bert.embed("still serving", timeout=TIMEOUT).embedding.shape == (64,)


def test_what_a_model_cannot_do_is_refused(bert, decoder, start_engine):
    with pytest.raises(InvalidRequestError, match="only embeds"):
        bert.generate("hello", SamplingParams(max_tokens=2), timeout=TIMEOUT)
    with pytest.raises(InvalidRequestError, match="needs an encoder"):
        decoder.embed("hello", PoolingParams(pooling="cls"), timeout=TIMEOUT)
    generator = start_engine(model="tiny", runtime="serial").client(timeout=TIMEOUT)
    assert generator.info.pooling is None
    with pytest.raises(InvalidRequestError, match="cannot embed"):
        generator.embed("hello", timeout=TIMEOUT)
    assert generator.generate("hello", SamplingParams(max_tokens=2), timeout=TIMEOUT).token_ids


@pytest.mark.parametrize(
    ("model", "pooling", "message"),
    [("tiny", "cls", "needs an encoder"), ("tiny-bert", "none", "nothing to do")],
)
def test_a_pooling_the_model_cannot_serve_is_refused_at_start(model, pooling, message):
    """Accepted before: every request then failed, naming the request's field."""
    with pytest.raises(mpengine.EngineStartError, match=message):
        mpengine.launch(model=model, pooling=pooling, runtime="serial", log_level="ERROR")


def test_an_encoder_whose_inputs_cannot_fit_a_step_is_refused_at_start():
    """An encoder computes an input whole: with a step budget below the model's length, a
    long input failed even when it asked to be truncated."""
    with pytest.raises(mpengine.EngineStartError, match=r"max_num_batched_tokens .* below"):
        mpengine.launch(
            model="tiny-bert", max_num_batched_tokens=64, runtime="serial", log_level="ERROR"
        )
