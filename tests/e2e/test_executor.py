"""The executor against Hugging Face on tiny models, driven by hand-built StepPlans.

``Driver`` plays a minimal scheduler: staggered arrivals, chunked prefill mixed into decode
steps under a token budget, shuffled block ids, slot reuse, and optional preemption by
recompute. Greedy tokens must equal HF ``generate`` exactly (fp32 CPU); a mismatch reports
HF's top-2 logit gap at that step, since tiny random models have near-ties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from mpengine.config import EngineConfig
from mpengine.executor import Executor, native_attention, torch_attention
from mpengine.executor.compiled import CompiledDecode
from mpengine.protocol import Array, SamplingParams, StepPlan, StepResult
from mpengine.testing.fake import start_seq

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@dataclass
class Seq:
    seq_id: int
    prompt: np.ndarray
    params: SamplingParams
    max_tokens: int
    arrival: int = 0
    sample_index: int = 0
    slot: int = -1
    computed: int = 0
    slot_sampled: bool = False  # the slot holds this sequence's last token (-1 is usable)
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, np.ndarray]] = field(default_factory=list)
    prompt_logprobs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def known(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.output, np.int32)])


class Driver:
    """A minimal scheduler: FCFS, chunked prefill within a token budget."""

    def __init__(self, executor: Executor, chunk: int = 16, budget: int = 48, seed: int = 0):
        self.ex = executor
        self.chunk, self.budget = chunk, budget
        self.rng = np.random.default_rng(seed)
        self.free_blocks = list(self.rng.permutation(executor.info.num_blocks))
        self.free_slots = list(range(executor.config.num_slots))
        self.step = 0
        self.mixed_steps = 0  # steps with decodes and a multi-token chunk together
        self.preemptions = 0

    def run(self, seqs: list[Seq], preempt: dict[int, int] | None = None) -> list[Seq]:
        preempt = preempt or {}
        active: list[Seq] = []
        pending = sorted(seqs, key=lambda s: s.arrival)
        for _ in range(2000):
            while pending and pending[0].arrival <= self.step:
                active.append(pending.pop(0))
            if not active and not pending:
                return seqs
            for s in active:
                if preempt.get(s.seq_id) == self.step and s.slot >= 0:
                    self._release(s)
                    s.computed = 0
                    self.preemptions += 1
            self._execute(*self._plan(active))
            for s in active:
                if len(s.output) >= s.max_tokens:
                    self._release(s)
            active = [s for s in active if len(s.output) < s.max_tokens]
            self.step += 1
        raise AssertionError("driver did not finish")

    def _release(self, s: Seq) -> None:
        self.free_blocks += s.blocks
        self.rng.shuffle(self.free_blocks)
        self.free_slots.append(s.slot)
        s.blocks, s.slot, s.slot_sampled = [], -1, False

    def _plan(self, active: list[Seq]) -> tuple[StepPlan, list[Seq]]:
        bs = self.ex.info.block_size
        budget, rows, tokens, new, updates = self.budget, [], [], [], []
        params = []
        for s in active:
            known = s.known
            n = min(len(known) - s.computed, self.chunk, budget)
            if n <= 0 or (s.slot < 0 and not self.free_slots):
                continue
            if s.slot < 0:
                s.slot = self.free_slots.pop(0)
                with_prompt = s.params.prompt_logprobs is not None and not s.prompt_logprobs
                ids = Array.of(s.prompt) if with_prompt else None
                start, request = start_seq(
                    s.slot, s.seq_id, len(s.prompt), s.params, s.sample_index, ids
                )
                new.append(start)
                params.append(request)
            while len(s.blocks) * bs < s.computed + n:
                updates.append((s.slot, len(s.blocks), self.free_blocks[-1]))
                s.blocks.append(self.free_blocks.pop())
            chunk = known[s.computed : s.computed + n].copy()
            if n == 1 and s.slot_sampled:
                chunk[:] = -1  # the slot's last sampled token
            tokens.append(chunk)
            rows.append((s, s.computed, n, s.computed + n == len(known)))
            budget -= n
        block_slots, block_indices, block_ids = (
            (np.asarray(c, np.int32) for c in zip(*updates, strict=True))
            if updates
            else ([], [], [])
        )
        plan = StepPlan(
            step=self.step,
            starts=Array.of([r[1] for r in rows]),
            token_ids=Array.of(np.concatenate(tokens)),
            slots=Array.of([r[0].slot for r in rows]),
            num_tokens=Array.of([r[2] for r in rows]),
            sample=Array.of([r[3] for r in rows], "bool"),
            seq_ids=Array.of([r[0].seq_id for r in rows], "int64"),
            new_seqs=new,
            block_slots=Array.of(block_slots),
            block_indices=Array.of(block_indices),
            block_ids=Array.of(block_ids),
            new_requests=params,
        )
        return plan, [r[0] for r in rows]

    def _execute(self, plan: StepPlan, scheduled: list[Seq]) -> StepResult:
        num_tokens = plan.num_tokens.numpy()
        self.mixed_steps += bool((num_tokens == 1).any() and (num_tokens > 1).any())
        result = self.ex.execute(plan)
        assert result.error is None, result.error
        for s, n in zip(scheduled, num_tokens, strict=True):
            s.computed += int(n)
        by_id = {s.seq_id: s for s in scheduled}
        for row, (seq_id, token) in enumerate(
            zip(result.seq_ids.numpy(), result.token_ids.numpy(), strict=True)
        ):
            s = by_id[int(seq_id)]
            s.output.append(int(token))
            s.slot_sampled = True
            if result.logprobs is not None and row in result.logprob_rows.numpy():
                r = list(result.logprob_rows.numpy()).index(row)
                lp = result.logprobs
                assert lp.token_ids.numpy()[r] == token
                s.logprobs.append((float(lp.logprobs.numpy()[r]), lp.top_ids.numpy()[r]))
        for entry in result.prompt_logprobs:
            lp = entry.logprobs
            by_id[entry.seq_id].prompt_logprobs[entry.start] = (
                lp.token_ids.numpy(),
                lp.logprobs.numpy(),
            )
        return result


def hf_model(executor: Executor) -> torch.nn.Module:
    """The reference: the same checkpoint with transformers' default attention, never
    stopping at EOS (the executor does not know about stops)."""
    model = AutoModelForCausalLM.from_pretrained(executor.info.model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def make_executor(model: str, **overrides: object) -> Executor:
    kwargs = dict(
        model=model, block_size=4, num_gpu_blocks_override=512, max_num_seqs=3, num_threads=1
    )
    kwargs.update(overrides)
    return Executor(EngineConfig.from_kwargs(**kwargs))


def hf_greedy(
    model: torch.nn.Module, prompt: np.ndarray, num_tokens: int
) -> tuple[list[int], list[float]]:
    """HF generate (no EOS stop): tokens and the top-2 logit gap at each step."""
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=num_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    gaps = [float(lg[0].topk(2).values.diff().abs()) for lg in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), gaps


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]


def check_greedy(executor: Executor, chunk: int = 16, budget: int = 40) -> None:
    lengths = [1, 5, 17, 33, 64, 100, 9, 48]
    seqs = [
        Seq(i, p, GREEDY, max_tokens=12, arrival=(i * 3) % 7)
        for i, p in enumerate(prompts(executor.info.vocab_size, lengths))
    ]
    driver = Driver(executor, chunk=chunk, budget=budget)
    driver.run(seqs)
    assert driver.mixed_steps >= 3
    hf = hf_model(executor)
    for s in seqs:
        expected, gaps = hf_greedy(hf, s.prompt, s.max_tokens)
        if s.output != expected:
            k = next(i for i, (a, b) in enumerate(zip(s.output, expected, strict=True)) if a != b)
            pytest.fail(
                f"seq {s.seq_id} (prompt {len(s.prompt)}) differs at token {k}: "
                f"{s.output} vs HF {expected}; HF top-2 gap there {gaps[k]:.2e}"
            )


@pytest.mark.parametrize(
    ("model", "decodes"),
    [
        ("tiny", "padded"),
        ("tiny", "chunked"),
        ("tiny", "native"),
        ("tiny-llama", "chunked"),
        ("tiny-llama", "native"),
        ("tiny-gpt2", "padded"),
        ("tiny-gpt2", "native"),
    ],
)
def test_greedy_matches_hf(model: str, decodes: str, monkeypatch) -> None:
    # Decodes of uneven contexts share steps: force each layout of the torch backend's decode
    # call (chunked: each sequence's own blocks, 2 per chunk; padded: to the longest context),
    # or the native kernel, which reads each sequence's blocks in place.
    if decodes == "native":
        if native_attention.kernels() is None:
            pytest.skip("no C compiler: the native kernels cannot be built here")
        check_greedy(make_executor(model, attention_backend="native"))
        return
    ratio = 0.0 if decodes == "chunked" else float("inf")
    monkeypatch.setattr(torch_attention, "CHUNKED_PADDING_RATIO", ratio)
    monkeypatch.setattr(torch_attention, "MAX_CHUNK_BLOCKS", 2)
    check_greedy(make_executor(model, attention_backend="torch"))


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_reused_blocks_do_not_carry_their_last_owners_rows(backend: str) -> None:
    """A block back from the free pool held its last owner's rows until the new owner
    filled them, and the torch backend's gathers read them (masked): one non-finite value
    there made the new owner's output NaN. A block is zeroed when its first row is
    written: a cache full of NaN, as if every block had served such an owner, serves HF's
    tokens."""
    if backend == "native" and native_attention.kernels() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    executor = make_executor("tiny", attention_backend=backend)
    executor.kv_storage.fill_(float("nan"))
    check_greedy(executor)


def test_compiled_decode_steps_match_hf() -> None:
    """compile_decode: pure-decode steps through torch.compile (the native kernels as graph
    operators) give HF's greedy tokens, with no compilation after start-up; prefill and
    mixed steps stay eager."""
    if native_attention.kernels() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    executor = make_executor(
        "tiny", attention_backend="native", compile_decode=True, num_threads=None
    )
    assert executor.compiled is not None
    # Graphs for each count the tuner may pick (dynamo guards on the thread count).
    assert executor.threads is not None or executor.config.max_threads == 1
    calls = {"compiled": 0}
    forward = executor.compiled.forward

    def counted(**kwargs: object) -> object:
        calls["compiled"] += 1
        return forward(**kwargs)

    executor.compiled.forward = counted
    # Every batch size, context length and thread count after the warm-up runs the graphs
    # it compiled.
    with torch._dynamo.config.patch(error_on_recompile=True):
        check_greedy(executor)
    assert calls["compiled"] > 10 and not executor.compiled.failed


def test_compile_decode_says_when_it_does_not_apply(caplog) -> None:
    executor = make_executor("tiny", attention_backend="torch", compile_decode=True)
    assert executor.compiled is None
    assert "compile_decode ignored" in caplog.text and "torch attention" in caplog.text


def test_a_failing_compiled_step_falls_back_to_eager(caplog) -> None:
    """If the compiled forward raises, that step is run again eagerly and so is every
    later one: the tokens stay HF's."""
    if native_attention.kernels() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    executor = make_executor("tiny", attention_backend="native")
    executor.compiled = CompiledDecode(executor.model, executor.kv_caches)

    def broken(**kwargs: object) -> object:
        raise RuntimeError("inductor fell over")

    executor.compiled.forward = broken
    check_greedy(executor)
    assert executor.compiled.failed and "decode steps now run eagerly" in caplog.text


@pytest.fixture(scope="module")
def tiny() -> Executor:
    return make_executor("tiny")


def test_repetition_penalty_matches_hf(tiny: Executor) -> None:
    """HF's repetition penalty is vLLM's (prompt and output tokens, divide or multiply)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8)
    seqs = [
        Seq(i, p, params, max_tokens=10, arrival=i)
        for i, p in enumerate(prompts(2048, [3, 20, 41]))
    ]
    Driver(tiny, chunk=8, budget=24).run(seqs)
    hf = hf_model(tiny)
    for s in seqs:
        ids = torch.from_numpy(s.prompt.astype(np.int64))[None]
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=None,
            pad_token_id=0,
            repetition_penalty=1.8,
        )
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert s.output == expected[0, len(s.prompt) :].tolist()


def test_min_tokens_suppresses_stop_ids(tiny: Executor) -> None:
    prompt = prompts(2048, [11], 7)[0]
    free = Driver(tiny).run([Seq(0, prompt, GREEDY, 6)])[0].output
    stop = free[0]
    params = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[stop])
    held = Driver(tiny).run([Seq(1, prompt, params, 6)])[0].output
    assert stop not in held[:4] and held[0] != free[0]


def test_logprobs_match_hf(tiny: Executor) -> None:
    """Sample and prompt logprobs are log_softmax of the raw model logits, prompt logprobs
    arrive per chunk and cover prompt tokens 1 .. P-1 exactly once."""
    params = SamplingParams(temperature=0.7, seed=5, logprobs=4, prompt_logprobs=3)
    seqs = [
        Seq(0, prompts(2048, [29])[0], params, max_tokens=6),
        Seq(1, prompts(2048, [2], 3)[0], GREEDY, 4),
    ]
    seqs.append(
        Seq(2, prompts(2048, [45], 2)[0], SamplingParams(temperature=0.0, logprobs=0), 5, arrival=1)
    )
    Driver(tiny, chunk=8, budget=20).run(seqs)
    hf = hf_model(tiny)
    for s in seqs[0], seqs[2]:
        tokens = torch.from_numpy(s.known.astype(np.int64))[None]
        with torch.no_grad():
            ref = hf(tokens).logits[0].log_softmax(-1)
        p = len(s.prompt)
        for k, (logprob, top_ids) in enumerate(s.logprobs):
            row = ref[p - 1 + k]
            assert abs(logprob - float(row[s.output[k]])) < 1e-4
            assert top_ids.tolist() == row.topk(len(top_ids)).indices.tolist()
        assert len(s.logprobs) == s.max_tokens
    starts = sorted(seqs[0].prompt_logprobs)
    assert starts[0] == 1 and len(starts) > 1  # split across chunks
    ids = np.concatenate([seqs[0].prompt_logprobs[j][0] for j in starts])
    values = np.concatenate([seqs[0].prompt_logprobs[j][1] for j in starts])
    prompt = seqs[0].prompt
    np.testing.assert_array_equal(ids, prompt[1:])
    with torch.no_grad():
        ref = hf(torch.from_numpy(prompt.astype(np.int64))[None]).logits[0].log_softmax(-1)
    expected = ref[np.arange(len(prompt) - 1), prompt[1:]].numpy()
    np.testing.assert_allclose(values, expected, atol=1e-4)
    assert not seqs[1].prompt_logprobs and not seqs[1].logprobs


def test_seeded_sampling_is_batch_and_preemption_invariant(tiny: Executor) -> None:
    def seeded(sample_index: int = 0, **kw: object) -> Seq:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, frequency_penalty=0.3)
        return Seq(
            100 + sample_index,
            prompts(2048, [23], 9)[0],
            params,
            16,
            sample_index=sample_index,
            **kw,
        )

    def others() -> list[Seq]:
        sampled = SamplingParams(temperature=1.2, top_k=50)
        return [
            Seq(i, p, sampled, 12, arrival=i) for i, p in enumerate(prompts(2048, [7, 60, 31], 4))
        ]

    alone = Driver(tiny, chunk=64).run([seeded()])[0].output
    crowded = (
        Driver(tiny, chunk=5, budget=30, seed=1).run([*others(), seeded(arrival=2)])[-1].output
    )
    preempted = (
        Driver(tiny, chunk=16, seed=2)
        .run([seeded(arrival=1), *others()], preempt={100: 9})[0]
        .output
    )
    assert alone == crowded == preempted
    second = Driver(tiny).run([seeded(sample_index=1)])[0].output
    assert second != alone  # n > 1 samples of one request differ


def test_failed_step_returns_error_and_executor_recovers(tiny: Executor, monkeypatch) -> None:
    def run() -> list[list[int]]:
        seqs = [Seq(i, p, GREEDY, 5, arrival=i) for i, p in enumerate(prompts(2048, [12, 30]))]
        return [s.output for s in Driver(tiny, chunk=8).run(seqs)]

    before = run()
    (start_a, params_a), (start_b, params_b) = (
        start_seq(0, 41, 2, GREEDY),
        start_seq(1, 42, 1, GREEDY),
    )
    bad = StepPlan(
        step=99,
        starts=Array.of([0, 0]),
        token_ids=Array.of([5, 6, 7]),
        slots=Array.of([0, 1]),
        num_tokens=Array.of([2, 1]),
        sample=Array.of([True, True], "bool"),
        seq_ids=Array.of([41, 42], "int64"),
        new_seqs=[start_a, start_b],
        block_slots=Array.of([0, 1]),
        block_indices=Array.of([0, 0]),
        block_ids=Array.of([1, 10**6]),
        new_requests=[params_a, params_b],
    )
    result = tiny.execute(bad)
    assert result.error and "block id" in result.error
    assert result.failed_seq_ids.numpy().tolist() == [41, 42] and len(result.seq_ids) == 0
    no_blocks = msgspec_replace(bad, block_slots=Array.of([0]), block_indices=Array.of([0]))
    no_blocks = msgspec_replace(no_blocks, block_ids=Array.of([3]))
    result = tiny.execute(no_blocks)  # slot 1's position 0 has no block
    assert result.error and "no block" in result.error

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(tiny, "model", boom)
    good_blocks = msgspec_replace(bad, block_ids=Array.of([1, 2]))
    result = tiny.execute(good_blocks)
    assert result.error == "RuntimeError: device fell over"
    monkeypatch.undo()
    assert tiny.execute(good_blocks).error is None
    assert run() == before


@pytest.mark.parametrize(
    "error",
    [
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
    ],
)
@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_a_lost_device_ends_the_executor(
    tiny: Executor, monkeypatch, error: Exception, where: str
) -> None:
    """A device-side assert or an illegal address leaves the CUDA context unusable: every
    later step would fail too. Failing the step's sequences and serving on failed every
    request from then on, with nothing to restart the engine; the error now leaves the
    executor (its stage exits, and the launcher fails the requests with it)."""
    (start, params) = start_seq(0, 51, 1, GREEDY)
    plan = StepPlan(
        step=7,
        starts=Array.of([0]),
        token_ids=Array.of([5, 6, 7]),
        slots=Array.of([0]),
        num_tokens=Array.of([3]),
        sample=Array.of([True], "bool"),
        seq_ids=Array.of([51], "int64"),
        new_seqs=[start],
        block_slots=Array.of([0]),
        block_indices=Array.of([0]),
        block_ids=Array.of([1]),
        new_requests=[params],
    )

    def lost(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(tiny, "model" if where == "forward" else "_sample_rows", lost)
    with pytest.raises(type(error), match="CUDA error"):
        tiny.execute(plan)


def test_out_of_memory_is_not_a_lost_device() -> None:
    from mpengine.executor.executor import device_lost

    assert not device_lost(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not device_lost(RuntimeError("shape mismatch"))
    assert device_lost(RuntimeError("CUDA error: misaligned address"))


def test_readers_of_blocks_a_failed_writer_left_unwritten_fail_too(tiny: Executor) -> None:
    """The scheduler lets a request start after a prefix that another sequence of the
    same step computes. When that one cannot run, its blocks stay unwritten: the readers
    fail with it (they attended to whatever the blocks held), the others run."""
    block = tiny.info.block_size  # 4
    (a, a_params), (b, b_params), (c, c_params) = (
        start_seq(0, 61, 9, GREEDY),
        start_seq(1, 62, 9, GREEDY),
        start_seq(2, 63, 2, GREEDY),
    )
    bad_id = tiny.info.vocab_size  # writer a cannot run: a token id out of range
    plan = StepPlan(
        step=3,
        # a computes 8 tokens into blocks 10, 11; b starts after them, in block 12; c is
        # on its own in block 13
        starts=Array.of([0, 2 * block, 0]),
        token_ids=Array.of([*range(5, 12), bad_id, 20, 30]),
        slots=Array.of([0, 1, 2]),
        num_tokens=Array.of([2 * block, 1, 1]),
        sample=Array.of([True, True, True], "bool"),
        seq_ids=Array.of([61, 62, 63], "int64"),
        new_seqs=[a, b, c],
        block_slots=Array.of([0, 0, 1, 1, 1, 2]),
        block_indices=Array.of([0, 1, 0, 1, 2, 0]),
        block_ids=Array.of([10, 11, 10, 11, 12, 13]),
        new_requests=[a_params, b_params, c_params],
    )
    result = tiny.execute(plan)
    assert result.failed_seq_ids.numpy().tolist() == [61, 62]
    assert "out of range" in result.errors[0] and "prefix blocks" in result.errors[1]
    assert result.seq_ids.numpy().tolist() == [63]


def msgspec_replace(plan: StepPlan, **changes: object) -> StepPlan:
    import msgspec

    return msgspec.structs.replace(plan, **changes)


def test_cpu_runs_a_cpu_backend_eagerly(tiny: Executor) -> None:
    """The backend follows the device (native where its kernels build, else torch); CUDA
    graphs are never captured off a GPU."""
    expected = "native" if native_attention.kernels() is not None else "torch"
    assert tiny.backend == expected and tiny.graphs is None
    assert EngineConfig.from_kwargs(enforce_eager=True).enforce_eager
    with pytest.raises(ValueError, match="not one of"):
        Executor(tiny.config, attention_backend="flash")  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError, match="attention_backend"):
        EngineConfig.from_kwargs(attention_backend="flash")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="triton attention needs a CUDA device"):
            Executor(tiny.config, attention_backend="triton")
    if expected == "native":
        # What the kernels do not take falls back to torch by default, and is refused by name.
        assert make_executor("tiny", block_size=256).backend == "torch"
        with pytest.raises(ValueError, match="block_size <= 128"):
            make_executor("tiny", block_size=256, attention_backend="native")


def test_kv_cache_layout_and_sizing() -> None:
    ex = make_executor(
        "tiny-llama", num_gpu_blocks_override=None, kv_cache_bytes=3 << 20, block_size=16
    )
    config = AutoConfig.from_pretrained(ex.info.model_path)
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (2, config.num_key_value_heads, ex.info.num_blocks, 16, head_dim)
    assert len(ex.kv_caches) == config.num_hidden_layers
    assert all(tuple(kv.shape) == shape for kv in ex.kv_caches)
    per_block = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4
    assert ex.info.num_blocks == (3 << 20) // per_block
    assert ex.info.kv_cache_bytes == ex.info.num_blocks * per_block <= 3 << 20
    assert ex.info.max_model_len == config.max_position_embeddings and ex.info.eos_token_ids


def test_rejects_what_it_cannot_run_exactly(tmp_path) -> None:
    t5 = tmp_path / "t5"
    AutoConfig.for_model("t5", d_model=8, num_layers=1, num_heads=1).save_pretrained(t5)
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        make_executor(str(t5))
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        make_executor("tiny", max_model_len=10**6)
    path = build_model(tmp_path, "mistral", sliding_window=32)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        make_executor(path)
    assert make_executor(path, max_model_len=32).info.max_model_len == 32
    path = build_model(
        tmp_path / "dyn",
        "llama",
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
        },
    )
    with pytest.raises(NotImplementedError, match="longrope"):
        make_executor(path)
    assert make_executor(path, max_model_len=64).info.max_model_len == 64


_FAMILIES = {
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(num_key_value_heads=2),
    "phi3": dict(num_key_value_heads=4, pad_token_id=0),
}


def build_model(path, model_type: str, **overrides: object) -> str:
    """A throwaway tiny model with weights that keep activations at unit scale, so greedy
    choices are rarely near-ties."""
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    kwargs.update(_FAMILIES.get(model_type, {}))
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features**-0.5)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0, 1.0)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", sorted(_FAMILIES))
def test_other_families_match_hf(tmp_path, model_type: str) -> None:
    executor = make_executor(build_model(tmp_path, model_type))
    check_greedy(executor, chunk=12, budget=30)
