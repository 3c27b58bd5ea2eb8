"""The sampler on synthetic logits: support restrictions, penalties, seeds, logprobs."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from mpengine.executor.input_batch import InputBatch
from mpengine.executor.sampler import (
    Sampler,
    SamplingRows,
    apply_masks,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    argmax_rows,
    draw_seed,
    token_logprobs,
)
from mpengine.executor.slots import SlotState
from mpengine.protocol import SamplingParams
from mpengine.testing.fake import start_seq

VOCAB = 32
CPU = torch.device("cpu")


def rows(batch: int, **fields: object) -> SamplingRows:
    """Rows with every feature off, then ``fields`` (scalars broadcast to the batch)."""
    base: dict[str, object] = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seeded=False,
        draw_seeds=0,
        logprobs=-1,
    )
    dtypes = dict(top_k=np.int64, seeded=bool, draw_seeds=np.int64, logprobs=np.int32)
    base.update({k: v for k, v in fields.items() if k in base})
    arrays = {
        k: np.broadcast_to(np.asarray(v, dtypes.get(k, np.float32)), batch).copy()
        for k, v in base.items()
    }
    empty = np.zeros(0, np.int64)
    return SamplingRows(
        **arrays,
        penalty_rows=fields.get("penalty_rows", empty),
        penalty_tokens=fields.get("penalty_tokens", np.zeros((0, 0), np.int64)),
        penalty_is_output=fields.get("penalty_is_output", np.zeros((0, 0), bool)),
        banned_rows=fields.get("banned_rows", empty),
        banned_ids=fields.get("banned_ids", empty),
        bias_rows=fields.get("bias_rows", empty),
        bias_ids=fields.get("bias_ids", empty),
        bias_values=fields.get("bias_values", np.zeros(0, np.float32)),
    )


def logits(batch: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def draws(x: torch.Tensor, r: SamplingRows, n: int = 400) -> set[int]:
    """Tokens drawn from row 0 over n independent draws."""
    tokens = Sampler(CPU, seed=0).sample(x[:1].expand(n, -1), _repeat(r, n)).token_ids
    return set(tokens.tolist())


def _repeat(r: SamplingRows, n: int) -> SamplingRows:
    fields = {
        k: np.repeat(getattr(r, k)[:1], n)
        for k in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "seeded",
            "draw_seeds",
            "logprobs",
        )
    }
    return rows(n, **fields)


def test_greedy_is_argmax() -> None:
    x = logits()
    out = Sampler(CPU, 0).sample(x, rows(4, temperature=0.0))
    assert out.token_ids.tolist() == x.argmax(-1).tolist() and out.logprobs is None


def test_top_k_keeps_the_k_largest() -> None:
    x = logits()
    kept = apply_top_k(x.clone(), torch.tensor([3, 0, 1, 32]))
    assert set(torch.isfinite(kept[0]).nonzero().flatten().tolist()) == set(
        x[0].topk(3).indices.tolist()
    )
    assert torch.isfinite(kept[1]).all() and torch.isfinite(kept[3]).all()
    assert torch.isfinite(kept[2]).sum() == 1
    assert draws(x, rows(1, top_k=3)) == set(x[0].topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus() -> None:
    x = logits()
    probs = x.softmax(-1)
    order = probs[0].argsort(descending=True)
    nucleus = {}
    for p in (0.3, 0.7, 0.95):
        kept = apply_top_k_top_p(x.clone(), torch.zeros(4, dtype=torch.long), torch.full((4,), p))
        size = int((probs[0][order].cumsum(0) < p).sum()) + 1  # the token that crosses p stays
        nucleus[p] = set(order[:size].tolist())
        assert set(torch.isfinite(kept[0]).nonzero().flatten().tolist()) == nucleus[p]
    assert draws(x, rows(1, top_p=0.7)) <= nucleus[0.7]


def test_top_k_and_top_p_combine() -> None:
    x = logits()
    kept = apply_top_k_top_p(
        x.clone(), torch.tensor([2, 2, 0, 0]), torch.tensor([0.999, 1.0, 1.0, 0.999])
    )
    assert torch.isfinite(kept[:2]).sum(-1).tolist() == [2, 2]
    assert torch.isfinite(kept[2]).all()


def test_min_p_drops_unlikely_tokens() -> None:
    x = logits()
    probs = x.softmax(-1)
    kept = apply_min_p(x.clone(), torch.tensor([0.1, 0.0, 0.5, 1.0]))
    expected = (probs[0] >= 0.1 * probs[0].max()).nonzero().flatten().tolist()
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == expected
    assert torch.isfinite(kept[1]).all() and torch.isfinite(kept[3]).sum() == 1
    assert draws(x, rows(1, min_p=0.1)) <= set(expected)


def test_penalties_follow_vllm_semantics() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    # prompt: tokens 0, 1; output: 2, 2, 3
    tokens = np.array([[0, 1, 2, 2, 3, -1]])
    is_output = np.array([[False, False, True, True, True, True]])
    r = rows(
        1,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        penalty_rows=np.array([0]),
        penalty_tokens=tokens,
        penalty_is_output=is_output,
    )
    out = apply_penalties(x.clone(), r)[0].tolist()
    # repetition on prompt+output (positive / 2, negative * 2), then output-only penalties.
    assert out == pytest.approx([1.0, -4.0, 0.5 - 0.5 - 0.5, -2.0 - 0.5 - 0.25, 0.5, 3.0])


def test_min_tokens_bans_and_logprobs_stay_raw() -> None:
    x = logits(2)
    top = int(x[0].argmax())
    r = rows(
        2, temperature=0.0, logprobs=[3, -1], banned_rows=np.array([0]), banned_ids=np.array([top])
    )
    out = Sampler(CPU, 0).sample(x, r)
    assert out.token_ids[0] != top and out.token_ids[0] == int(x[0].topk(2).indices[1])
    assert out.logprob_rows.tolist() == [0]
    lp = out.logprobs
    raw = x[0].log_softmax(-1)
    assert lp.logprobs.numpy()[0] == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-6)
    assert (
        lp.top_ids.numpy()[0].tolist() == raw.topk(3).indices.tolist()
    )  # top includes the banned one
    np.testing.assert_allclose(lp.top_logprobs.numpy()[0], raw.topk(3).values.numpy(), atol=1e-6)


def test_logit_bias_adds_to_the_logits_before_penalties_and_logprobs_stay_raw() -> None:
    x = logits(3)
    top, low = int(x[0].argmax()), int(x[0].argmin())
    # row 0: +100 makes the least likely token win; row 1: -100 twice on one token adds
    # up (-inf-like); row 2: untouched
    r = rows(
        3,
        temperature=0.0,
        logprobs=[1, -1, -1],
        bias_rows=np.array([0, 1, 1]),
        bias_ids=np.array([low, top, top]),
        bias_values=np.array([100.0, -60.0, -60.0], np.float32),
    )
    out = Sampler(CPU, 0).sample(x, r)
    assert out.token_ids[0] == low
    biased = x[1].clone()
    biased[top] -= 120
    assert out.token_ids[1] == int(biased.argmax())
    assert out.token_ids[2] == int(x[2].argmax())
    raw = x[0].log_softmax(-1)
    assert out.logprobs.logprobs.numpy()[0] == pytest.approx(float(raw[low]), abs=1e-6)
    # sampled rows see the bias too: +100 leaves no other token a chance
    n = 50
    hot = rows(
        n,
        temperature=1.0,
        bias_rows=np.arange(n),
        bias_ids=np.full(n, low),
        bias_values=np.full(n, 100.0, np.float32),
    )
    assert set(Sampler(CPU, 0).sample(x[:1].expand(n, -1), hot).token_ids.tolist()) == {low}


def test_slots_carry_each_sequences_logit_bias() -> None:
    state = SlotState(4, 4, 64, VOCAB, eos_token_ids=[2])
    biased = SamplingParams(temperature=0.0, logit_bias={5: 3.0, 9: -1.5})
    state.start(*start_seq(1, 1, 3, biased))
    state.start(*start_seq(2, 2, 3, SamplingParams(temperature=0.0)))
    r = state.sampling_rows(np.array([2, 1]), np.array([3, 3]))
    assert r.bias_rows.tolist() == [1, 1]
    assert r.bias_ids.tolist() == [5, 9] and r.bias_values.tolist() == [3.0, -1.5]
    state.start(*start_seq(1, 3, 3, SamplingParams()))  # the slot's next sequence: none
    assert not len(state.sampling_rows(np.array([1]), np.array([3])).bias_rows)


def test_every_accepted_seed_is_its_own_stream() -> None:
    """Seeds 2**63 apart (-1 and 2**63 - 1, -2**63 and 0) draw differently: the sign bit
    counts, as in ``torch.Generator.manual_seed``."""
    state = SlotState(4, 4, 64, VOCAB, eos_token_ids=[2])
    seeds = [-1, 2**63 - 1, -(2**63), 0]
    for slot, seed in enumerate(seeds):
        state.start(*start_seq(slot, slot, 3, SamplingParams(seed=seed)))
    draws = state.sampling_rows(np.arange(4), np.full(4, 3)).draw_seeds.tolist()
    assert len(set(draws)) == 4


def test_logit_bias_is_checked() -> None:
    for bad, message in [
        ({5: 101.0}, "100"),
        ({-1: 1.0}, ">= 0"),
        ({5: float("nan")}, "finite"),
        ({i: 1.0 for i in range(1025)}, "1024"),
    ]:
        with pytest.raises((ValueError, msgspec.ValidationError), match=message):
            SamplingParams(logit_bias=bad).validate()
    with pytest.raises(ValueError, match="logit_bias: beam search does not support logit_bias"):
        SamplingParams(use_beam_search=True, beam_width=2, logit_bias={5: 1.0})


def test_logprobs_carry_each_chosen_tokens_rank() -> None:
    x = logits(3)
    chosen = torch.tensor([int(x[0].argmax()), int(x[1].argsort()[5]), int(x[2].argmin())])
    lp = token_logprobs(x, chosen, 2)
    order = x.argsort(dim=-1, descending=True)
    want = [int((order[i] == chosen[i]).nonzero()) + 1 for i in range(3)]
    assert lp.ranks.numpy().tolist() == want == [1, VOCAB - 5, VOCAB]


def test_prompt_logprobs_in_slices_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of scored positions run in slices (bounded temporaries): the same values."""
    from mpengine.executor import sampler

    x = logits(7)
    chosen = torch.tensor([3, 0, 9, 1, 2, 5, 4])
    whole = token_logprobs(x, chosen, 3)
    monkeypatch.setattr(sampler, "LOGPROB_SLICE_ROWS", 3)
    sliced = token_logprobs(x, chosen, 3)
    for field in ("token_ids", "logprobs", "top_ids", "top_logprobs", "ranks"):
        np.testing.assert_array_equal(
            getattr(sliced, field).numpy(), getattr(whole, field).numpy(), err_msg=field
        )
    assert sliced.logprobs.numpy().shape == (7,)


def test_seeded_rows_ignore_the_batch() -> None:
    x = logits(5)
    seeds = draw_seed(np.array([7, 7, 7]), np.array([0, 1, 0]), np.array([3, 3, 4]))
    assert len(set(seeds.tolist())) == 3 and (seeds >= 0).all()
    solo = Sampler(CPU, 1).sample(x[2:3], rows(1, seeded=True, draw_seeds=seeds[0])).token_ids[0]
    batch = rows(5, seeded=[False, False, True, False, False], draw_seeds=[0, 0, seeds[0], 0, 0])
    for engine_seed in range(5):
        assert Sampler(CPU, engine_seed).sample(x, batch).token_ids[2] == solo
    # Different draw seeds over many rows give different tokens (high temperature: near uniform).
    spread = rows(
        64,
        temperature=50.0,
        seeded=True,
        draw_seeds=draw_seed(np.full(64, 7), np.arange(64), np.zeros(64)),
    )
    assert len(set(Sampler(CPU, 0).sample(x[:1].expand(64, -1), spread).token_ids.tolist())) > 10


def test_temperature_sampling_follows_the_distribution() -> None:
    x = torch.tensor([[0.0, np.log(3.0), -30.0, -30.0]])
    n = 4000
    r = rows(n, temperature=1.0)
    tokens = Sampler(CPU, 3).sample(x.expand(n, -1), r).token_ids
    share = (tokens == 1).mean()
    assert 0.72 < share < 0.78 and set(tokens.tolist()) <= {0, 1}


def test_greedy_fast_path_takes_logits_as_they_are() -> None:
    """All-greedy rows without penalties are one argmax of the logits in their own dtype;
    logprobs still come from float32 log-softmax."""
    x = logits(3).to(torch.bfloat16)
    out = Sampler(CPU, 0).sample(x, rows(3, temperature=0.0, logprobs=[2, -1, 0]))
    assert out.token_ids.tolist() == x.float().argmax(-1).tolist()
    assert out.logprob_rows.tolist() == [0, 2]
    expected = x.float().log_softmax(-1)
    chosen = expected[[0, 2], out.token_ids[[0, 2]]]
    np.testing.assert_allclose(out.logprobs.logprobs.numpy(), chosen.numpy(), atol=1e-6)
    assert out.logprobs.top_ids.numpy().shape == (2, 2)


def test_async_sampling_waits_for_the_same_result() -> None:
    x = logits(6)
    r = rows(6, temperature=[0.0, 0.8, 1.0, 0.0, 1.3, 0.5], top_p=0.9, top_k=5, logprobs=1)
    pending = Sampler(CPU, 4).sample_async(x, r)
    assert pending.token_ids.dtype == torch.int32 and len(pending.token_ids) == 6
    waited = pending.wait()
    again = Sampler(CPU, 4).sample(x, r)
    assert waited.token_ids.tolist() == again.token_ids.tolist()
    assert waited.token_ids.tolist() == pending.token_ids.tolist()


def test_top_p_without_top_k_needs_no_top_k_tensor() -> None:
    x = logits()
    top_p = torch.full((4,), 0.8)
    off = apply_top_k_top_p(x.clone(), torch.zeros(4, dtype=torch.long), top_p)
    assert torch.equal(apply_top_k_top_p(x.clone(), None, top_p), off)
    assert torch.equal(
        apply_top_k(x.clone(), torch.tensor([3, 0, 1, 2]), max_k=3),
        apply_top_k(x.clone(), torch.tensor([3, 0, 1, 2])),
    )


def started_slots(device: torch.device) -> tuple[SlotState, InputBatch]:
    """Slots 0-5 started with varied sampling parameters, and their persistent batch."""
    state = SlotState(
        8, max_blocks_per_seq=4, max_model_len=64, vocab_size=VOCAB, eos_token_ids=[0]
    )
    batch = InputBatch(state, device, block_size=16, backend="torch", kv_caches=[])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8, seed=11),
        SamplingParams(temperature=1.0, min_p=0.2, top_k=VOCAB + 5),  # top-k off: > vocab
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=4),
        SamplingParams(temperature=0.0, top_k=2),
    ]
    for slot, p in enumerate(params):
        state.start(*start_seq(slot, seq_id=100 + slot, num_prompt_tokens=4, sampling=p))
    batch.sync_rows(np.arange(len(params)))
    return state, batch


def test_the_persistent_batch_params_draw_as_the_rows_do() -> None:
    """The draw's parameters kept per slot (the persistent batch's, gathered by slot) give
    the tokens that packing them from the step's rows gives."""
    state, batch = started_slots(CPU)
    slots = np.array([4, 1, 0, 3, 2, 5, 1, 2])
    r = state.sampling_rows(slots, contexts=np.full(len(slots), 6))
    x = logits(len(slots), seed=3)
    packed = Sampler(CPU, seed=7).sample(x, r).token_ids
    kept = Sampler(CPU, seed=7).sample_async(x, r, batch.sampling_params_of(slots)).wait()
    assert kept.token_ids.tolist() == packed.tolist()
    assert batch.sampling_params_of(slots)[3].tolist() == pytest.approx([1.0, 0.2, 1.0, 0.0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device mirror needs a GPU")
def test_started_slots_reach_the_device_mirror() -> None:
    state, batch = started_slots(torch.device("cuda"))
    assert batch.sampling_params.device.type == "cuda"
    np.testing.assert_array_equal(batch.sampling_params.cpu().numpy(), state.sampling_params)
    slots = np.array([2, 4])
    r = state.sampling_rows(slots, contexts=np.full(2, 6))
    x = logits(2, seed=5).cuda()
    sampler = Sampler(torch.device("cuda"), seed=3)
    kept = sampler.sample_async(x, r, batch.sampling_params_of(slots)).wait()
    assert (
        kept.token_ids.tolist() == Sampler(torch.device("cuda"), 3).sample(x, r).token_ids.tolist()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_rows_is_torch_argmax(dtype: torch.dtype) -> None:
    """The CPU path (numpy) picks what torch's argmax picks: the first of tied maxima, the
    first NaN, the first of tied infinities, index 0 of an all -inf row; strided rows too."""
    x = torch.randn(40, 300, generator=torch.Generator().manual_seed(0))
    x[3, 10] = x[3, 20] = float("nan")
    x[4] = 1.0
    x[5, 7] = x[5, 9] = float("inf")
    x[6] = -float("inf")
    x[7, 100] = x[7, 200] = x[7].max() + 1
    x = x.to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[3:8].tolist() == [10, 0, 7, 0, 100]
    strided = x.t().contiguous().t()
    assert torch.equal(argmax_rows(strided), x.argmax(dim=-1))


@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 2, 3]])
def test_grammar_masks_exclude_tokens_of_their_rows_only(rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=gen)
    allowed = torch.rand(len(rows), 10, generator=gen) > 0.5
    masked = apply_masks(logits, np.array(rows), allowed)
    free = [r for r in range(4) if r not in rows]
    assert torch.equal(masked[free], logits[free])
    assert torch.equal(torch.isinf(masked[rows]), ~allowed)
    assert torch.equal(masked[rows][allowed], logits[rows][allowed])
    assert not torch.isinf(logits).any()  # (the raw logits stay for logprobs)
