"""The output processor stage fed synthetic announcements and step results."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from mpengine.models.tiny_tokenizer import (
    QWEN3_TOKENIZER,
    sentencepiece_tokenizer,
    write_tokenizer,
)
from mpengine.output import OutputProcessor
from mpengine.protocol import (
    GONE_CLIENTS_PER_FEEDBACK,
    AbortRequests,
    Array,
    Feedback,
    Logprobs,
    NewRequest,
    OutputDelta,
    PoolingParams,
    PromptLogprobs,
    SamplingParams,
    StepResult,
)

Outputs = list[tuple[str, OutputDelta]]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tokenizer(QWEN3_TOKENIZER, path)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture
def proc(tokenizer_dir: Path, tok: Tokenizer) -> OutputProcessor:
    return OutputProcessor(str(tokenizer_dir), [tok.token_to_id("<|im_end|>")])


def eos(tok: Tokenizer) -> int:
    return tok.token_to_id("<|im_end|>")


def new(
    request_id: str,
    seq_ids: list[int],
    client: str = "c1",
    sampling: SamplingParams | None = None,
    **kwargs: object,
) -> NewRequest:
    if sampling is None:
        sampling = SamplingParams(**kwargs)  # type: ignore[arg-type]
    return NewRequest(request_id, client, seq_ids, 7, sampling, None, 100.0, 101.0)


def result(step: int, pairs: list[tuple[int, int]], **kwargs: object) -> StepResult:
    seq_ids = Array.of([s for s, _ in pairs], "int64")
    token_ids = Array.of([t for _, t in pairs], "int32")
    return StepResult(step, seq_ids, token_ids, **kwargs)  # type: ignore[arg-type]


def feed(proc: OutputProcessor, seq_id: int, ids: list[int]) -> tuple[list[Feedback], Outputs]:
    """One token per step for one sequence."""
    feedbacks, outputs = [], []
    for step, token_id in enumerate(ids):
        feedback, out = proc.process(result(step, [(seq_id, token_id)]))
        feedbacks.append(feedback)
        outputs += out
    return feedbacks, outputs


def joined(outputs: Outputs, index: int = 0) -> tuple[str, list[int]]:
    deltas = [d for _, d in outputs if d.index == index]
    return "".join(d.text for d in deltas), [
        t for d in deltas for t in d.token_ids.numpy().tolist()
    ]


def test_streams_text_and_finishes_on_length(proc: OutputProcessor, tok: Tokenizer) -> None:
    text = "The cat sat on the mat, 日本語 and 😀."
    ids = tok.encode(text).ids
    proc.announce(new("r1", [5], max_tokens=len(ids)))
    assert proc.num_unfinished == 1
    feedbacks, outputs = feed(proc, 5, ids)
    assert all(client == "c1" for client, _ in outputs)
    assert len(outputs) == len(ids)  # one delta per step: every token is visible
    assert joined(outputs) == (text, ids)
    assert all("\ufffd" not in d.text for _, d in outputs)
    final = outputs[-1][1]
    assert (final.finish_reason, final.stop_reason, final.num_prompt_tokens) == ("length", None, 7)
    assert (final.arrival_time, final.scheduled_time) == (100.0, 101.0)
    assert final.finished_time >= final.first_token_time > 101.0
    assert all(d.finish_reason is None for _, d in outputs[:-1])
    assert [f.token_ids.numpy().tolist() for f in feedbacks] == [[t] for t in ids]
    assert all(f.seq_ids.numpy().tolist() == [5] for f in feedbacks)
    assert feedbacks[-1].finished_seq_ids == [5] and feedbacks[-1].finish_reasons == ["length"]
    assert all(not f.finished_seq_ids for f in feedbacks[:-1])
    assert proc.num_unfinished == 0


def test_eos_stops_and_its_text_is_not_sent(proc: OutputProcessor, tok: Tokenizer) -> None:
    ids = tok.encode("Hi there").ids
    proc.announce(new("r1", [1], skip_special_tokens=False))
    feedbacks, outputs = feed(proc, 1, [*ids, eos(tok)])
    assert joined(outputs) == ("Hi there", [*ids, eos(tok)])
    final = outputs[-1][1]
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    assert feedbacks[-1].finished_seq_ids == [1]
    assert feedbacks[-1].token_ids.numpy().tolist() == [eos(tok)]


def test_ignore_eos_and_min_tokens(proc: OutputProcessor, tok: Tokenizer) -> None:
    proc.announce(new("a", [1], ignore_eos=True, max_tokens=3, skip_special_tokens=False))
    proc.announce(new("b", [2], min_tokens=2, max_tokens=5))
    steps = [
        [(1, eos(tok)), (2, eos(tok))],
        [(1, 33), (2, eos(tok))],
        [(1, eos(tok)), (2, eos(tok))],
    ]
    outputs: Outputs = []
    for step, pairs in enumerate(steps):
        outputs += proc.process(result(step, pairs))[1]
    a = [d for _, d in outputs if d.request_id == "a"]
    b = [d for _, d in outputs if d.request_id == "b"]
    assert a[-1].finish_reason == "length"
    assert "".join(d.text for d in a).count("<|im_end|>") == 2
    # EOS inside min_tokens is a token like any other; the one after ends the sequence.
    assert [d.finish_reason for d in b] == [None, None, "stop"]


def test_stop_token_ids(proc: OutputProcessor, tok: Tokenizer) -> None:
    ids = tok.encode("one, two; three").ids
    stop_id = ids[3]
    proc.announce(new("a", [1], stop_token_ids=[stop_id]))
    proc.announce(new("b", [2], stop_token_ids=[stop_id], include_stop_str_in_output=True))
    outputs: Outputs = []
    for step, token in enumerate(ids[:4]):
        outputs += proc.process(result(step, [(1, token), (2, token)]))[1]
    a, b = joined(outputs[0::2]), joined(outputs[1::2])
    assert a == (tok.decode(ids[:3]), ids[:4])
    assert b == (tok.decode(ids[:4]), ids[:4])
    assert outputs[-1][1].stop_reason == stop_id and outputs[-1][1].finish_reason == "stop"


def test_eos_takes_precedence_over_stop_ids_and_stop_strings_over_length(
    proc: OutputProcessor, tok: Tokenizer
) -> None:
    proc.announce(new("a", [1], stop_token_ids=[eos(tok)]))
    _, out = proc.process(result(0, [(1, eos(tok))]))
    assert (out[0][1].finish_reason, out[0][1].stop_reason) == ("stop", None)
    ids = tok.encode("ab").ids
    proc.announce(new("b", [2], stop=["b"], max_tokens=len(ids)))
    _, out = feed(proc, 2, ids)
    assert (out[-1][1].finish_reason, out[-1][1].stop_reason) == ("stop", "b")


def test_stop_string_across_tokens_is_held_back(proc: OutputProcessor, tok: Tokenizer) -> None:
    text = "Answer: 42 </answer> trailing"
    ids = tok.encode(text).ids
    proc.announce(new("r", [3], stop=["</answer>"], max_tokens=100))
    feedbacks, outputs = feed(proc, 3, ids)
    stop_at = next(i for i, (_, d) in enumerate(outputs) if d.finish_reason)
    assert joined(outputs)[0] == "Answer: 42 "
    # No delta ever carried a piece of the stop string.
    assert all("<" not in d.text for _, d in outputs)
    assert outputs[stop_at][1].stop_reason == "</answer>"
    assert feedbacks[stop_at].finished_seq_ids == [3]
    assert len(outputs) == stop_at + 1  # later tokens were ignored
    assert all(not f.token_ids.numpy().size for f in feedbacks[stop_at + 1 :])


def test_stop_string_include_and_prefix_release(proc: OutputProcessor, tok: Tokenizer) -> None:
    ids = tok.encode("x <b> y <br> z").ids
    proc.announce(new("a", [1], stop=["<br>"], include_stop_str_in_output=True, max_tokens=99))
    proc.announce(new("b", [2], stop=["<bx"], max_tokens=len(ids)))
    outputs: Outputs = []
    for step, token in enumerate(ids):
        outputs += proc.process(result(step, [(1, token), (2, token)]))[1]
    a = "".join(d.text for _, d in outputs if d.request_id == "a")
    b = "".join(d.text for _, d in outputs if d.request_id == "b")
    assert a == "x <b> y <br>"
    assert b == "x <b> y <br> z"  # held prefixes were released, and at the end


def test_multibyte_split_never_sends_replacement_chars(
    proc: OutputProcessor, tok: Tokenizer
) -> None:
    text = "😀🎉👍🏽 東京 — naïve Ωμέγα"
    ids = tok.encode(text).ids
    proc.announce(new("r", [1], max_tokens=len(ids), stop=["Ω"]))
    _, outputs = feed(proc, 1, ids)
    assert any(d.text == "" for _, d in outputs)  # a fragment step sent tokens, no text
    assert all("\ufffd" not in d.text for _, d in outputs)
    assert joined(outputs)[0] == "😀🎉👍🏽 東京 — naïve "


def test_n_samples_finish_independently(proc: OutputProcessor, tok: Tokenizer) -> None:
    proc.announce(new("r", [10, 11, 12], n=3, max_tokens=3))
    a, b = tok.encode("a").ids[0], tok.encode("b").ids[0]
    fb0, out0 = proc.process(result(0, [(10, a), (11, b), (12, eos(tok))]))
    assert [(d.index, d.text, d.finish_reason) for _, d in out0] == [
        (0, "a", None),
        (1, "b", None),
        (2, "", "stop"),
    ]
    assert fb0.finished_seq_ids == [12] and proc.num_unfinished == 1
    # Async depth 1: seq 12 was planned once more; its token is neither sent nor accepted.
    fb1, out1 = proc.process(result(1, [(10, a), (11, b), (12, a)]))
    assert [d.index for _, d in out1] == [0, 1]
    assert fb1.seq_ids.numpy().tolist() == [10, 11]
    fb2, out2 = proc.process(result(2, [(10, a), (11, b)]))
    assert [d.finish_reason for _, d in out2] == ["length", "length"]
    assert fb2.finished_seq_ids == [10, 11] and proc.num_unfinished == 0


def test_abort_announcement(proc: OutputProcessor, tok: Tokenizer) -> None:
    proc.announce(new("r", [1, 2], n=2, stop=["zzz"], max_tokens=9))
    proc.announce(new("other", [3]))
    proc.process(result(0, [(1, tok.encode("z").ids[0]), (2, 40), (3, 40)]))
    out = proc.announce(AbortRequests("c1", ["r", "unknown"], reason="error", message="boom"))
    assert [(d.index, d.finish_reason, d.error) for _, d in out] == [
        (0, "error", "boom"),
        (1, "error", "boom"),
    ]
    assert out[0][1].text == "z"  # the held stop-string prefix is released
    assert proc.num_unfinished == 1
    feedback, out = proc.process(result(1, [(1, 40), (3, 40)]))
    assert [d.request_id for _, d in out] == ["other"]
    assert feedback.finished_seq_ids == []  # the scheduler aborted them itself
    assert proc.announce(AbortRequests("c1", ["r"])) == []


def test_drop_client(proc: OutputProcessor) -> None:
    proc.announce(new("a", [1, 2], client="gone", n=2))
    proc.announce(new("b", [3], client="stays"))
    proc.process(result(0, [(1, 40), (2, 41), (3, 42)]))
    proc.drop_client("gone")
    assert proc.num_unfinished == 1
    feedback, out = proc.process(result(1, [(1, 40), (2, 41), (3, 42)]))
    assert [client for client, _ in out] == ["stays"]
    assert feedback.finished_seq_ids == [1, 2] and feedback.finish_reasons == ["abort", "abort"]
    assert feedback.seq_ids.numpy().tolist() == [3]
    feedback, _ = proc.process(result(2, [(3, 42)]))
    assert feedback.finished_seq_ids == []  # reported once


def test_gone_client_is_reported_once_and_its_later_requests_end_at_once(
    proc: OutputProcessor,
) -> None:
    """The scheduler learns of a gone client once (to drop what it still queues), and a
    request of it announced afterwards (queued before the scheduler knew) ends silently."""
    proc.announce(new("a", [1], client="gone"))
    assert proc.drop_client("gone") and not proc.drop_client("gone")
    feedback, out = proc.process(result(0, [(1, 40)]))
    assert out == [] and feedback.gone_clients == ["gone"] and feedback.finished_seq_ids == [1]
    proc.announce(new("late", [2], client="gone"))
    proc.announce(new("b", [3], client="stays"))
    feedback, out = proc.process(result(1, [(2, 40), (3, 41)]))
    assert [client for client, _ in out] == ["stays"]
    assert feedback.gone_clients == [] and feedback.finished_seq_ids == [2]
    assert proc.num_unfinished == 1


def test_a_connection_greeting_under_a_gone_id_is_a_new_client(proc: OutputProcessor) -> None:
    proc.drop_client("svc")
    proc.client_back("svc")  # before the news went out: the scheduler is not told
    proc.announce(new("a", [1], client="svc"))
    feedback, out = proc.process(result(0, [(1, 40)]))
    assert feedback.gone_clients == [] and [c for c, _ in out] == ["svc"]
    proc.client_back("never-gone")  # (nothing to forget)


def test_gone_clients_are_reported_in_bounded_feedback(proc: OutputProcessor) -> None:
    clients = [f"c{i}" for i in range(GONE_CLIENTS_PER_FEEDBACK + 3)]
    for client in clients:
        proc.drop_client(client)
    first, _ = proc.process(result(0, []))
    second, _ = proc.process(result(1, []))
    assert first.gone_clients + second.gone_clients == clients
    assert len(first.gone_clients) == GONE_CLIENTS_PER_FEEDBACK


def test_failed_step(proc: OutputProcessor) -> None:
    proc.announce(new("a", [1]))
    proc.announce(new("b", [2]))
    proc.process(result(0, [(1, 40), (2, 41)]))
    failed = StepResult(
        1,
        Array.of([], "int64"),
        Array.of([]),
        failed_seq_ids=Array.of([1, 2, 99], "int64"),
        errors=["device lost", "bad token", "unknown"],
    )
    feedback, out = proc.process(failed)
    assert [(d.request_id, d.finish_reason, d.error) for _, d in out] == [
        ("a", "error", "device lost"),
        ("b", "error", "bad token"),
    ]
    assert feedback.finished_seq_ids == [1, 2] and feedback.finish_reasons == ["error", "error"]
    assert proc.num_unfinished == 0


def logprobs(rows: int, width: int, base: float = 0.0) -> Logprobs:
    top = np.arange(rows * width).reshape(rows, width)
    return Logprobs(
        Array.of(np.arange(rows) + 100),
        Array.of(np.arange(rows) - base, "float32"),
        Array.of(top),
        Array.of(-top - base, "float32"),
    )


def test_logprobs_and_prompt_logprobs(proc: OutputProcessor) -> None:
    proc.announce(new("a", [1, 2], n=2, logprobs=2, prompt_logprobs=1, max_tokens=2))
    proc.announce(new("b", [3]))
    chunks = [PromptLogprobs(1, 3, logprobs(2, 3, 10.0)), PromptLogprobs(1, 0, logprobs(3, 3))]
    step0 = result(
        0,
        [(3, 50), (1, 51), (2, 52)],
        logprobs=logprobs(2, 4),
        logprob_rows=Array.of([1, 2]),  # row j belongs to seq_ids[logprob_rows[j]]
        prompt_logprobs=chunks,
    )
    _, out = proc.process(step0)
    b, a0, a1 = (d for _, d in out)
    assert b.logprobs is None and b.prompt_logprobs is None
    assert a0.logprobs.token_ids.numpy().tolist() == [100]  # type: ignore[union-attr]
    assert a1.logprobs.top_ids.numpy().tolist() == [[4, 5]]  # type: ignore[union-attr]
    assert a1.prompt_logprobs is None  # only sample 0 carries them
    prompt = a0.prompt_logprobs
    assert prompt is not None
    assert prompt.token_ids.numpy().tolist() == [100, 101, 102, 100, 101]  # in position order
    assert prompt.top_ids.numpy().shape == (5, 1)
    _, out = proc.process(result(1, [(1, 51)], logprobs=logprobs(1, 4), logprob_rows=Array.of([0])))
    assert out[0][1].prompt_logprobs is None and out[0][1].logprobs is not None


def test_prompt_logprobs_keep_the_first_value_of_a_position(proc: OutputProcessor) -> None:
    # Preempted before its first output, sample 0 recomputes (and rescores) its prompt.
    proc.announce(new("a", [1], logprobs=0, prompt_logprobs=0))
    chunks = [
        PromptLogprobs(1, 1, logprobs(2, 0)),
        PromptLogprobs(1, 1, logprobs(3, 0, 50.0)),
        PromptLogprobs(1, 4, logprobs(1, 0, 50.0)),
    ]
    _, out = proc.process(
        result(
            0, [(1, 7)], logprobs=logprobs(1, 0), logprob_rows=Array.of([0]), prompt_logprobs=chunks
        )
    )
    prompt = out[0][1].prompt_logprobs
    assert prompt is not None
    assert prompt.logprobs.numpy().tolist() == [0.0, 1.0, -48.0, -50.0]
    assert prompt.top_ids.numpy().shape == (4, 0)
    assert out[0][1].logprobs.top_ids.numpy().shape == (1, 0)  # type: ignore[union-attr]


def test_embeddings(tokenizer_dir: Path) -> None:
    proc = OutputProcessor(str(tokenizer_dir / "tokenizer.json"), [2])
    proc.announce(NewRequest("e", "c", [4], 5, None, PoolingParams("mean", True), 1.0, 2.0))
    proc.announce(NewRequest("d", "c", [6], 5, None, PoolingParams("last", True, 2), 1.0, 2.0))
    proc.announce(new("g", [7], max_tokens=5))
    emb = Array.of(np.array([[1, 2, 3], [4, 5, 0]]), "float32")
    # A step that samples one sequence and pools two (rows in pooled_seq_ids order; a row
    # asking for fewer dimensions has zeros past them).
    step = StepResult(
        0,
        Array.of([7], "int64"),
        Array.of([40]),
        pooled_seq_ids=Array.of([4, 6], "int64"),
        embeddings=emb,
    )
    feedback, out = proc.process(step)
    by_id = {delta.request_id: delta for _, delta in out}
    assert by_id["e"].embedding.numpy().tolist() == [1, 2, 3]  # type: ignore[union-attr]
    assert by_id["d"].embedding.numpy().tolist() == [4, 5]  # type: ignore[union-attr]
    assert by_id["e"].finish_reason == "stop" and by_id["e"].num_prompt_tokens == 5
    assert by_id["g"].finish_reason is None
    # The scheduler finished the pooled sequences when it planned their last chunk.
    assert feedback.finished_seq_ids == [] and feedback.seq_ids.numpy().tolist() == [7]
    assert proc.num_unfinished == 1


def test_max_model_len_caps_the_output(tokenizer_dir: Path) -> None:
    proc = OutputProcessor(str(tokenizer_dir), [2], max_model_len=10)
    proc.announce(new("a", [1], max_tokens=50))  # 7 prompt tokens: room for 3
    _, out = feed(proc, 1, [40, 41, 42, 43])
    assert [d.finish_reason for _, d in out] == [None, None, "length"]


def test_the_package_needs_neither_torch_nor_transformers() -> None:
    package = Path(__file__).parents[2] / "mpengine" / "output"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not [n for n in names if n.split(".")[0] in ("torch", "transformers")], path


def reference(text: str, stops: list[str]) -> str:
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))]
    return text


@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_final_text_equals_a_full_decode(
    tokenizer_dir: Path, tok: Tokenizer, data: st.DataObject, skip: bool
) -> None:
    proc = OutputProcessor(str(tokenizer_dir), [eos(tok)])
    vocab = [i for i in range(tok.get_vocab_size()) if i != eos(tok)]
    ids = data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=30))
    full = tok.decode(ids, skip_special_tokens=skip)
    pieces = [full[i : i + 2] for i in range(0, len(full), 3) if "\ufffd" not in full[i : i + 2]]
    stops = data.draw(st.lists(st.sampled_from(pieces), max_size=2)) if pieces else []
    proc.announce(new("r", [1], max_tokens=len(ids), stop=stops, skip_special_tokens=skip))
    _, outputs = feed(proc, 1, ids)
    text, sent_ids = joined(outputs)
    assert text == reference(full, stops)
    assert sent_ids == ids[: len(sent_ids)]
    assert outputs[-1][1].finish_reason == ("stop" if text != full else "length")


def test_request_ids_are_scoped_to_their_client(proc: OutputProcessor) -> None:
    proc.announce(new("same", [1], client="alice"))
    proc.announce(new("same", [2], client="bob"))
    assert proc.num_unfinished == 2
    # Bob aborting "same" ends only his request.
    out = proc.announce(AbortRequests("bob", ["same"]))
    assert [(client, d.request_id, d.finish_reason) for client, d in out] == [
        ("bob", "same", "abort")
    ]
    _, out = proc.process(result(0, [(1, 40), (2, 41)]))
    assert [client for client, _ in out] == ["alice"]


def test_abort_client_returns_final_deltas_and_reports_them(proc: OutputProcessor) -> None:
    proc.announce(new("a", [1, 2], client="slow", n=2))
    proc.announce(new("b", [3], client="fast"))
    proc.process(result(0, [(1, 40), (2, 41), (3, 42)]))
    finals = proc.abort_client("slow", "too slow")
    assert sorted((d.index, d.finish_reason, d.error) for _, d in finals) == [
        (0, "abort", "too slow"),
        (1, "abort", "too slow"),
    ]
    feedback, out = proc.process(result(1, [(1, 40), (3, 42)]))
    assert [client for client, _ in out] == ["fast"]
    assert sorted(feedback.finished_seq_ids) == [1, 2]
    assert proc.abort_client("slow", "again") == []


def sampled_step(
    number: int, seq_ids: list[int], token: int, values: list[float], failed: tuple[int, ...] = ()
) -> StepResult:
    """Step ``number``: each of ``seq_ids`` sampled ``token`` with logprob ``values[i]``
    (no alternatives); ``failed`` sequences failed in it."""
    num = len(seq_ids)
    logprobs = Logprobs(
        Array.of([token] * num),
        Array.of(values, "float32"),
        Array.of(np.zeros((num, 0)), "int32"),
        Array.of(np.zeros((num, 0)), "float32"),
    )
    return StepResult(
        number,
        Array.of(seq_ids, "int64"),
        Array.of([token] * num),
        logprobs=logprobs,
        logprob_rows=Array.of(list(range(num))),
        failed_seq_ids=Array.of(list(failed), "int64"),
        errors=["boom"] * len(failed),
    )


def test_best_of_holds_every_sample_and_returns_the_n_most_likely(
    proc: OutputProcessor, tok: Tokenizer
) -> None:
    params = SamplingParams(n=2, best_of=3, max_tokens=2, ignore_eos=True)
    proc.announce(NewRequest("r", "c1", [1, 2, 3], 7, params, None, 100.0, 101.0))
    token = tok.encode("ab").ids[0]

    def step(number: int, values: list[float]) -> StepResult:
        return sampled_step(number, [1, 2, 3], token, values)

    feedback, out = proc.process(step(0, [-1.0, -0.5, -3.0]))
    assert out == [] and feedback.seq_ids.numpy().tolist() == [1, 2, 3]  # held, not sent
    feedback, out = proc.process(step(1, [-1.0, -0.25, -0.1]))
    assert sorted(feedback.finished_seq_ids) == [1, 2, 3]
    deltas = [d for _, d in out]
    # Sample 2 (-0.75) then sample 1 (-2.0); sample 3 (-3.1) is dropped.
    assert [(d.index, d.cumulative_logprob) for d in deltas] == [(0, -0.75), (1, -2.0)]
    assert all(len(d.token_ids) == 2 and d.finish_reason == "length" for d in deltas)
    assert deltas[0].num_generated_tokens == 6 and deltas[0].logprobs is None
    assert proc.num_unfinished == 0


def test_best_of_ranks_a_failed_sample_last(proc: OutputProcessor, tok: Tokenizer) -> None:
    """A sample that failed has no tokens, so its cumulative logprob (0.0) was the best:
    best_of returned the error and dropped the samples that finished."""
    params = SamplingParams(n=1, best_of=3, max_tokens=2, ignore_eos=True)
    proc.announce(NewRequest("r", "c1", [1, 2, 3], 7, params, None, 100.0, 101.0))
    token = tok.encode("ab").ids[0]
    proc.process(sampled_step(0, [2, 3], token, [-1.0, -0.5], failed=(1,)))
    feedback, out = proc.process(sampled_step(1, [2, 3], token, [-1.0, -2.0]))
    assert sorted(feedback.finished_seq_ids) == [2, 3]
    ((_, delta),) = out
    assert (delta.index, delta.finish_reason, delta.error) == (0, "length", None)
    assert delta.cumulative_logprob == -2.0  # sample 2 (-2.0) over sample 3 (-2.5)
    assert proc.num_unfinished == 0


def test_an_error_processing_one_request_fails_that_request_only(
    proc: OutputProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception in the output stage stopped the engine: now it fails its request, with
    the error, and the others of the step go on."""
    proc.announce(new("a", [1]))
    proc.announce(new("b", [2]))
    original = proc._on_token

    def on_token(seq, token_id, now):
        if seq.request.msg.request_id == "a":
            raise OverflowError("boom")
        return original(seq, token_id, now)

    monkeypatch.setattr(proc, "_on_token", on_token)
    feedback, out = proc.process(result(0, [(1, 40), (2, 41)]))
    failed = [d for _, d in out if d.request_id == "a"]
    assert [(d.finish_reason, d.error) for d in failed] == [
        ("error", "internal error in the output processor: OverflowError: boom")
    ]
    assert [d.token_ids.numpy().tolist() for _, d in out if d.request_id == "b"] == [[41]]
    assert feedback.finished_seq_ids == [1] and feedback.finish_reasons == ["error"]
    monkeypatch.setattr(proc, "_on_token", original)
    _, out = proc.process(result(1, [(1, 42), (2, 43)]))  # seq 1's token is never seen
    assert [d.request_id for _, d in out] == ["b"]


def test_outputs_are_decoded_after_the_prompts_tail(tmp_path: Path) -> None:
    """With a SentencePiece-style tokenizer the first output word kept no space: "Hello" +
    "▁the" read "Hellothe" in echo and in prompt + completion. The announcement carries
    the prompt's last tokens and the text follows them, as vLLM's does; without them (an
    older scheduler) the text is the outputs' own decode."""
    tokenizer = sentencepiece_tokenizer()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    proc = OutputProcessor(str(tmp_path), [tokenizer.token_to_id("</s>")])
    prompt = tokenizer.encode("Hello").ids
    word = tokenizer.encode("the the").ids[-1]
    for request_id, tail, want in [("r1", Array.of(prompt), " the the"), ("r2", None, "the the")]:
        msg = NewRequest(
            request_id, "c1", [1], len(prompt), SamplingParams(max_tokens=2), None, 0.0, 0.0
        )
        msg.prompt_tail = tail
        proc.announce(msg)
        assert joined(feed(proc, 1, [word, word])[1]) == (want, [word, word])
