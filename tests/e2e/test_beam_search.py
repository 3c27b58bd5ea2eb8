"""Beam search against transformers' ``generate(num_beams=W, do_sample=False, ...)``.

Exact tokens for beam widths 1, 2, 4 and 8 on each built-in causal model, with length
penalties and every ``early_stopping`` mode, the ``n`` best returned in order; scores equal
transformers' ``sequences_scores`` to float32 rounding. A small KV cache makes beams
preempt each other. Beams continuing other beams share their full blocks.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mpengine import InvalidRequestError, SamplingParams
from mpengine.models.resolve import resolve_model
from mpengine.testing.engine import wait_idle

TIMEOUT = 300.0
PROMPTS = [[10, 20, 30, 40, 50], list(range(100, 137)), [7], list(range(60, 80))]
# (beam width, n, length_penalty, early_stopping)
CASES = [(1, 1, 1.0, False), (2, 2, 1.0, False), (4, 2, 0.5, True), (8, 3, 2.0, "never")]
MAX_TOKENS = 12


@functools.cache
def hf_model(name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(name)).eval()


def hf_beams(
    name: str, prompt: list[int], width: int, n: int, penalty: float, early, stops=()
) -> tuple:
    model = hf_model(name)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    eos += stops
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=width,
            num_return_sequences=n,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            length_penalty=penalty,
            early_stopping=early,
            pad_token_id=model.generation_config.pad_token_id or 0,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
        )
    sequences = []
    for row in out.sequences[:, len(prompt) :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        sequences.append(row[:end])  # transformers pads after EOS
    scores = out.sequences_scores.tolist() if width > 1 else None
    return sequences, scores


@pytest.fixture(scope="module", params=["tiny", "tiny-llama", "tiny-gpt2"])
def engine(request, start_engine):
    # 32 blocks of 4 tokens: beams share their prompt blocks, but two requests of 8 beams
    # of up to 49 tokens do not fit at once, so beams preempt each other.
    return request.param, start_engine(
        model=request.param, block_size=4, num_gpu_blocks_override=32, max_num_seqs=16
    )


@pytest.mark.parametrize(("width", "n", "penalty", "early"), CASES)
def test_equals_transformers(engine, width, n, penalty, early):
    name, eng = engine
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        use_beam_search=True,
        beam_width=width,
        n=n,
        length_penalty=penalty,
        early_stopping=early,
    )
    with eng.client(timeout=TIMEOUT) as client:
        outs = client.generate_many(PROMPTS, params, timeout=TIMEOUT)
        stats = wait_idle(client)  # the last beam steps' feedback may still be on its way
    for prompt, out in zip(PROMPTS, outs, strict=True):
        sequences, scores = hf_beams(name, prompt, width, n, penalty, early)
        assert [o.token_ids for o in out.outputs] == sequences, (name, width, prompt)
        if scores is not None:
            got = [o.cumulative_logprob for o in out.outputs]
            assert got == pytest.approx(scores, abs=1e-5)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    if width == 8:
        assert stats.preemptions > 0, "8 beams of these prompts do not fit the KV cache at once"


def test_generated_tokens_count_every_beam_step(engine):
    """The step that ends a search decides a token per beam too (it went uncounted: a
    benchmark's beam tokens/s came out (max_tokens - 1) / max_tokens of the truth)."""
    _, eng = engine
    params = SamplingParams(
        max_tokens=5,
        use_beam_search=True,
        beam_width=2,
        n=2,
        ignore_eos=True,
        early_stopping="never",
    )
    with eng.client(timeout=TIMEOUT) as client:
        before = wait_idle(client).generated_tokens
        outs = client.generate_many([[5, 6, 7], [8, 9]], params, timeout=TIMEOUT)
        after = wait_idle(client).generated_tokens
    assert [len(o.token_ids) for out in outs for o in out.outputs] == [5] * 4
    assert after - before == 2 * 2 * 5


def test_beam_search_is_not_streamed_and_is_checked(engine):
    _, eng = engine
    with eng.client(timeout=TIMEOUT) as client:
        beams = SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2)
        with pytest.raises(InvalidRequestError, match="cannot be streamed"):
            next(client.stream([1, 2, 3], beams))
        for bad in ({"stop": ["x"]}, {"logprobs": 1}, {"n": 3}):
            with pytest.raises(ValueError, match="beam"):
                SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, **bad).validate()
        # Too wide for the 64 continuations a step returns: the limit, in beams.
        wide = SamplingParams(max_tokens=4, use_beam_search=True, beam_width=33, n=1)
        with pytest.raises(InvalidRequestError, match=r"33 beams .* At most 32 beams"):
            client.generate([1, 2, 3], wide, timeout=TIMEOUT)
        # Still serving, and the blocks all came back.
        assert client.generate([1, 2, 3], beams, timeout=TIMEOUT).outputs[0].token_ids
        stats = wait_idle(client)
        assert stats.num_free_blocks == stats.num_blocks


def test_stop_token_ids_end_beams_as_more_eos_tokens(engine):
    """Each token that ends a beam adds a continuation per beam and step (transformers
    keeps ``(1 + #eos) x width``): with 20 in all, 8 beams took no stop_token_ids at all."""
    name, eng = engine
    prompt = PROMPTS[0]
    plain, _ = hf_beams(name, prompt, 8, 8, 0.0, False)
    stops = sorted({row[2] for row in plain})[:4]  # (no length penalty: short ones win)
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        use_beam_search=True,
        beam_width=8,
        n=4,
        length_penalty=0.0,
        stop_token_ids=stops,
    )
    with eng.client(timeout=TIMEOUT) as client:
        out = client.generate(prompt, params, timeout=TIMEOUT)
    sequences, scores = hf_beams(name, prompt, 8, 4, 0.0, False, stops)
    assert any(len(s) < MAX_TOKENS for s in sequences)  # the stops did end beams
    assert [o.token_ids for o in out.outputs] == sequences
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx(scores, abs=1e-5)


def test_beams_beside_a_long_recompute_do_not_livelock(start_engine):
    """A beam group waiting on a preempted beam held blocks that a preempted request's
    recompute then needed half-way: that request preempted itself, resumed first again, and
    the engine ran steps forever. A resume now waits for room for its whole context, and a
    sequence out of blocks preempts a waiting beam before itself."""
    engine = start_engine(
        model="tiny", num_gpu_blocks_override=12, max_num_seqs=32, max_num_batched_tokens=40
    )
    prompts = [list(range(100, 142)), list(range(300, 343)), [606]]
    params = [
        SamplingParams(max_tokens=13, ignore_eos=True, use_beam_search=True, beam_width=3),
        SamplingParams(
            max_tokens=30, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3
        ),
        SamplingParams(max_tokens=29, ignore_eos=True, temperature=0.0),
    ]
    with engine.client(timeout=TIMEOUT) as client:
        for _ in range(5):
            outs = client.generate_many(prompts, params, timeout=60)  # 0.1 s each here
            assert [len(o.token_ids) for o in outs] == [13, 30, 29]
        stats = wait_idle(client)
    assert stats.preemptions > 0 and stats.num_free_blocks == stats.num_blocks
