"""mpengine/structured: grammar texts and their checks; the executor's matchers advance by
the tokens read from the slots' history, in a worker thread or at once, keep their state
across a preemption, and end with EOS."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from mpengine.models.resolve import resolve_model
from mpengine.protocol import RequestParams, SamplingParams, StructuredOutputs
from mpengine.structured.grammars import InvalidGrammar, check, grammar_text
from mpengine.structured.matchers import GrammarError, GrammarMatchers

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


def request(key: int, spec: StructuredOutputs | None) -> RequestParams:
    sampling = SamplingParams(structured_outputs=spec)
    return RequestParams(key=key, num_prompt_tokens=3, sampling=sampling)


def allowed_texts(tokenizer, mask: np.ndarray) -> set[str]:
    return {tokenizer.decode([int(t)]) for t in np.flatnonzero(mask)}


def test_checks_name_the_kind_and_cache() -> None:
    check(StructuredOutputs(choice=["a", "b"]))
    assert grammar_text(StructuredOutputs(regex="a+")) is grammar_text(
        StructuredOutputs(regex="a+")
    )
    with pytest.raises(InvalidGrammar, match=r"^structured_outputs\.regex: .*unclosed"):
        check(StructuredOutputs(regex="(a"))
    with pytest.raises(InvalidGrammar, match=r"^structured_outputs\.grammar: "):
        check(StructuredOutputs(grammar="root ::= ("))  # GBNF, converted to Lark first
    with pytest.raises(InvalidGrammar, match="JSON schema is an object"):
        check(StructuredOutputs(json="[1, 2]"))


@pytest.mark.parametrize("overlap", [False, True])
def test_masks_follow_the_consumed_tokens(tokenizer, overlap: bool) -> None:
    vocab = len(tokenizer)
    matchers = GrammarMatchers(resolve_model("tiny"), vocab, [EOS], overlap=overlap)
    matchers.start(7, request(1, StructuredOutputs(choice=["yes", "no"])))
    matchers.start(8, request(2, None))  # unconstrained: no matcher
    history = np.zeros((4, 32), np.int32)
    seq_ids, slots, prompt = np.array([7, 8]), np.array([1, 2]), np.array([3, 3])

    masks = matchers.fill(seq_ids, slots, prompt, np.array([0, 0]), history)
    assert masks is not None and masks.rows.tolist() == [0]
    rows, allowed = masks.select(np.arange(2))
    assert rows.tolist() == [0] and allowed.shape == (1, vocab)
    first = allowed_texts(tokenizer, allowed[0].numpy())
    assert first and all("yes".startswith(t) or "no".startswith(t) for t in first)

    # The sequence drew "no": its tokens are in the history; it may only end now.
    no = tokenizer.encode("no", add_special_tokens=False)
    history[1, 3 : 3 + len(no)] = no
    masks = matchers.fill(seq_ids[:1], slots[:1], prompt[:1], np.array([len(no)]), history)
    _, allowed = masks.select(np.arange(1))
    assert np.flatnonzero(allowed[0].numpy()).tolist() == [EOS]

    # Preempted and resumed in another slot: the same matcher, where it was.
    matchers.start(7, request(1, StructuredOutputs(choice=["yes", "no"])))
    history[3, 3 : 3 + len(no) + 1] = [*no, EOS]
    masks = matchers.fill(seq_ids[:1], np.array([3]), prompt[:1], np.array([len(no) + 1]), history)
    _, allowed = masks.select(np.arange(1))
    assert allowed[0].all()  # planned ahead of its EOS: the draw is dropped, any mask will do

    # A second request of the same grammar copies the compiled one.
    matchers.start(9, request(3, StructuredOutputs(choice=["yes", "no"])))
    matchers.fill(np.array([9]), np.array([0]), prompt[:1], np.array([0]), history).wait()
    assert len(matchers._prototypes) == 1

    matchers.release([1, 2, 3])
    assert matchers.fill(seq_ids, slots, prompt, np.array([0, 0]), history) is None


def test_a_token_the_grammar_refuses_fails_its_row_only(tokenizer) -> None:
    matchers = GrammarMatchers(resolve_model("tiny"), len(tokenizer), [EOS], overlap=False)
    for seq_id in (1, 2):
        matchers.start(seq_id, request(seq_id, StructuredOutputs(regex="[0-9]+")))
    history = np.zeros((2, 16), np.int32)
    history[0, 3] = tokenizer.encode("x", add_special_tokens=False)[0]  # not a digit
    history[1, 3] = tokenizer.encode("7", add_special_tokens=False)[0]
    masks = matchers.fill(
        np.array([1, 2]), np.array([0, 1]), np.array([3, 3]), np.array([1, 1]), history
    )
    with pytest.raises(GrammarError, match="structured outputs"):
        masks.select(np.arange(2))
    rows, allowed = masks.select(np.array([1]))  # the other row samples
    assert rows.tolist() == [0]
    assert all(
        t.isdigit() or t == ""
        for t in allowed_texts(tokenizer, allowed[0].numpy()) - {tokenizer.decode([EOS])}
    )
