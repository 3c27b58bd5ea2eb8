"""The engine against Hugging Face ``generate``, token for token (fp32 on CPU, greedy).

32+ concurrent requests per architecture, prompt lengths spread over 1..300, varied
``max_tokens``, a KV cache small enough that preemption must happen, a token budget small
enough that long prompts are chunked; under the processes runtime at async depth 0 and 1,
and under the serial runtime. Each request alone through HF is the reference.

Exact is the bar. A mismatch passes only as a *near-tie*: HF's logits at that position
rank the two tokens within 1e-4 of each other; near-ties are counted and reported, never
silently accepted, and a request is compared only up to its first one.
"""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch

from mpengine.models.resolve import resolve_model
from mpengine.protocol import SamplingParams
from mpengine.testing.engine import wait_idle

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_REQUESTS = 36
NEAR_TIE = 1e-4
# 640 token slots for 36 requests of up to 340 tokens: preemption must happen.
PRESSURE = {
    "num_gpu_blocks_override": 40,
    "block_size": 16,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
}
RUNTIMES = [
    pytest.param({"runtime": "processes", "async_depth": 0}, id="processes-depth0"),
    pytest.param({"runtime": "processes", "async_depth": 1}, id="processes-depth1"),
    pytest.param({"runtime": "serial", "async_depth": 0}, id="serial"),
]


@functools.cache
def hf_model(name: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32)
    return model.eval()


@functools.cache
def workload(name: str) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs, deterministic per model."""
    model = hf_model(name)
    rng = random.Random(1234)
    vocab = model.config.vocab_size
    lengths = [1, 2, 3, 300, 299, 17, 16, 15, 33, 64, 128, 200, 250]
    lengths += [rng.randint(1, 300) for _ in range(NUM_REQUESTS - len(lengths))]
    return [([rng.randrange(vocab) for _ in range(n)], rng.randint(1, 40)) for n in lengths]


@functools.cache
def shared_prefix_workload(name: str) -> list[tuple[list[int], int]]:
    """Requests that start with one of three long "system prompts" (prefix caching reuses
    their blocks; the small cache evicts and preempts), deterministic per model."""
    rng = random.Random(99)
    vocab = hf_model(name).config.vocab_size
    systems = [[rng.randrange(vocab) for _ in range(n)] for n in (150, 97, 64)]
    requests = []
    for i in range(NUM_REQUESTS):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        requests.append((systems[i % 3] + tail, rng.randint(1, 40)))
    return requests


@functools.cache
def hf_reference(name: str, shared: bool = False, penalty: float = 1.0) -> list[list[int]]:
    model = hf_model(name)
    refs = []
    with torch.no_grad():
        for prompt, max_tokens in (shared_prefix_workload if shared else workload)(name):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=model.generation_config.pad_token_id or 0,
            )
            refs.append(out[0, len(prompt) :].tolist())
    return refs


def logit_gap(name: str, context: list[int], a: int, b: int) -> float:
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([context])).logits[0, -1]
    return abs(float(logits[a] - logits[b]))


# Every runtime on tiny, every other family on the default one (processes, depth 1): what a
# runtime changes (the loop, async depth) does not depend on the architecture, and what a
# family changes (positions, attention) not on the runtime.
PAIRS = [pytest.param("tiny", r.values[0], id=f"tiny-{r.id}") for r in RUNTIMES]
PAIRS += [
    pytest.param(name, RUNTIMES[1].values[0], id=f"{name}-{RUNTIMES[1].id}")
    for name in ("tiny-llama", "tiny-gpt2")
]


@pytest.mark.parametrize(("name", "runtime"), PAIRS)
def test_greedy_tokens_equal_hf_generate(name, runtime, start_engine):
    refs = hf_reference(name)
    engine = start_engine(
        model=name,
        **PRESSURE,
        **runtime,
    )
    with engine.client() as client:
        prompts = [prompt for prompt, _ in workload(name)]
        params = [SamplingParams(max_tokens=m, temperature=0.0) for _, m in workload(name)]
        outputs = client.generate_many(prompts, params, timeout=600)
        stats = wait_idle(client)
    assert stats.preemptions > 0, "the KV cache was sized so that preemption must happen"
    assert stats.num_free_blocks == stats.num_blocks

    check_against_hf(name, workload(name), outputs, refs, runtime)


def check_against_hf(name, requests, outputs, refs, label) -> None:
    """Exact, or a reported near-tie at the first mismatch (at most two)."""
    near_ties = []
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        got = out.token_ids
        if got == ref:
            continue
        prompt = requests[i][0]
        pos = next(
            (k for k, (g, r) in enumerate(zip(got, ref, strict=False)) if g != r),
            min(len(got), len(ref)),
        )
        assert pos < min(len(got), len(ref)), (
            f"request {i}: lengths differ without a token mismatch: {len(got)} vs {len(ref)} "
            f"(finish_reason {out.finish_reason})"
        )
        gap = logit_gap(name, prompt + ref[:pos], got[pos], ref[pos])
        assert gap < NEAR_TIE, (
            f"request {i} (prompt {len(prompt)} tokens): token {pos} is {got[pos]}, HF says "
            f"{ref[pos]}; their logits differ by {gap:.3g} (not a near-tie)"
        )
        near_ties.append((i, pos, gap))
    if near_ties:
        print(f"{name} {label}: {len(near_ties)} near-tie(s) (request, position, gap): {near_ties}")
    assert len(near_ties) <= 2, f"too many near-ties to be chance: {near_ties}"


@pytest.mark.parametrize("runtime", RUNTIMES[1:])
def test_shared_prefixes_with_prefix_caching_equal_hf_generate(runtime, start_engine):
    """Prefix caching on, prompts sharing long prefixes, a cache small enough to evict and
    preempt: still HF's tokens."""
    name = "tiny"
    requests = shared_prefix_workload(name)
    refs = hf_reference(name, shared=True)
    engine = start_engine(
        model=name,
        **PRESSURE,
        prefix_caching=True,
        **runtime,
    )
    with engine.client() as client:
        params = [SamplingParams(max_tokens=m, temperature=0.0) for _, m in requests]
        outputs = client.generate_many([p for p, _ in requests], params, timeout=600)
        stats = wait_idle(client)
    assert stats.prefix_cache_hits > 0 and stats.num_free_blocks == stats.num_blocks
    check_against_hf(name, requests, outputs, refs, runtime)


def test_repetition_penalty_counts_cached_and_shared_prompt_tokens(start_engine):
    """A repetition penalty counts every prompt token, also those a sequence reads from
    cached blocks or shares with its sibling samples (n = 2), and outputs recomputed after a
    preemption: HF's tokens (``generate(repetition_penalty=...)``), for every sample."""
    name, penalty = "tiny", 1.3
    requests = shared_prefix_workload(name)
    refs = hf_reference(name, shared=True, penalty=penalty)
    engine = start_engine(model=name, **PRESSURE, prefix_caching=True)
    with engine.client() as client:
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, repetition_penalty=penalty, n=1 + i % 2)
            for i, (_, m) in enumerate(requests)
        ]
        outputs = client.generate_many([p for p, _ in requests], params, timeout=600)
        stats = wait_idle(client)
    assert stats.prefix_cache_hits > 0 and stats.preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks
    for out in outputs:  # greedy samples of one request are one and the same
        assert all(s.token_ids == out.outputs[0].token_ids for s in out.outputs)
    check_against_hf(name, requests, outputs, refs, f"repetition_penalty={penalty}")


@pytest.mark.parametrize(("swap_blocks", "label"), [(4096, "swap"), (10, "swap-full")])
def test_swap_preemption_equals_hf_generate(swap_blocks, label, start_engine):
    """Swap preemption under the same pressure: swapped sequences resume with their own
    KV back from host memory; with little swap space the rest recompute. HF's tokens."""
    name = "tiny"
    refs = hf_reference(name)
    engine = start_engine(
        model=name,
        **PRESSURE,
        preemption_mode="swap",
        swap_space=swap_blocks * 32768,  # tiny's KV block: 4 layers x 2 x 16 x 2 x 32 x 4 B
        prefix_caching=False,
    )
    with engine.client() as client:
        prompts = [prompt for prompt, _ in workload(name)]
        params = [SamplingParams(max_tokens=m, temperature=0.0) for _, m in workload(name)]
        outputs = client.generate_many(prompts, params, timeout=600)
        stats = wait_idle(client)
    assert stats.preemptions > 0 and stats.swapped_out_blocks > 0
    assert stats.swapped_in_blocks == stats.swapped_out_blocks  # every swapped one resumed
    assert stats.num_swapped == 0 and stats.num_free_blocks == stats.num_blocks
    check_against_hf(name, workload(name), outputs, refs, label)
