"""Incremental detokenization equals a full decode, and never emits half a character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpengine.models.tiny_tokenizer import (
    GPT2_TOKENIZER,
    LLAMA_TOKENIZER,
    QWEN3_TOKENIZER,
    sentencepiece_tokenizer,
    write_tokenizer,
)
from mpengine.output.detokenizer import (
    MAX_PENDING_TOKENS,
    ByteStream,
    Detokenizer,
    WindowStream,
)
from mpengine.protocol import PROMPT_TAIL_TOKENS

# The tokenizers of the tiny models (tiny, tiny-llama, tiny-gpt2), built without torch.
SPECS = {"qwen3": QWEN3_TOKENIZER, "llama": LLAMA_TOKENIZER, "gpt2": GPT2_TOKENIZER}


@pytest.fixture(scope="module", params=sorted(SPECS))
def detok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Detokenizer:
    path = tmp_path_factory.mktemp(request.param)
    write_tokenizer(SPECS[request.param], path)
    return Detokenizer.from_path(str(path))


SENTENCEPIECE = sentencepiece_tokenizer()


def run(stream: ByteStream | WindowStream, ids: list[int]) -> tuple[list[str], str]:
    """Push every id; return the pieces and everything including the flush."""
    pieces = [stream.push(i) for i in ids]
    return pieces, "".join(pieces) + stream.flush()


# Text with many multi-byte characters, most of them not whole tokens in the vocabulary.
unicode_text = st.text(
    st.one_of(
        st.sampled_from("日本語のテキスト中文한국어😀🎉👍🏽 café naïve Ωμέγα ẞ\n"),
        # (U+FFFD itself is what the test looks for in the output)
        st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\ufffd"),
    ),
    max_size=40,
)


def test_byte_level_tokenizers_take_the_fast_path(detok: Detokenizer) -> None:
    assert detok.byte_level
    assert isinstance(detok.stream(), ByteStream)
    assert not Detokenizer(SENTENCEPIECE).byte_level


def test_multibyte_characters_split_across_tokens(detok: Detokenizer) -> None:
    text = "東京で😀を見た"
    ids = detok.tokenizer.encode(text).ids
    table = detok._table(True)
    # The test is only meaningful if some token is a fragment of a character.
    assert any(table.texts[i] is None for i in ids)
    pieces, full = run(detok.stream(), ids)
    assert full == text
    assert "\ufffd" not in "".join(pieces)
    assert "" in pieces  # a fragment produced nothing until its character was complete


def test_first_token_may_be_a_fragment(detok: Detokenizer) -> None:
    ids = detok.tokenizer.encode("😀 ok").ids
    for start in range(len(ids)):
        tail = ids[start:]
        _, full = run(detok.stream(), tail)
        assert full == detok.decode(tail)
        _, full = run(WindowStream(detok.tokenizer, True), tail)
        assert full == detok.decode(tail)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_ids_match_a_full_decode(
    detok: Detokenizer, data: st.DataObject, skip: bool
) -> None:
    vocab_size = detok.tokenizer.get_vocab_size()
    # Special tokens, the first ids, and ids past the vocabulary (a padded embedding).
    ids = data.draw(st.lists(st.integers(0, vocab_size + 8), max_size=24))
    want = detok.decode(ids, skip_special_tokens=skip)
    assert run(detok.stream(skip), ids)[1] == want
    assert run(WindowStream(detok.tokenizer, skip), ids)[1] == want


@settings(max_examples=150, deadline=None)
@given(text=unicode_text)
def test_real_text_streams_without_replacement_characters(detok: Detokenizer, text: str) -> None:
    ids = detok.tokenizer.encode(text).ids
    for stream in (detok.stream(), WindowStream(detok.tokenizer, True)):
        pieces, full = run(stream, ids)
        assert full == detok.decode(ids)
        assert "\ufffd" not in "".join(pieces)


@settings(max_examples=150, deadline=None)
@given(text=unicode_text)
def test_sentencepiece_style_text_matches_a_full_decode(text: str) -> None:
    ids = SENTENCEPIECE.encode(text).ids
    pieces, full = run(WindowStream(SENTENCEPIECE, True), ids)
    assert full == SENTENCEPIECE.decode(ids)
    assert "\ufffd" not in "".join(pieces)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_sentencepiece_style_random_word_ids(data: st.DataObject, skip: bool) -> None:
    # Byte-fallback tokens are left out: ByteFallback decodes an invalid byte group to one
    # U+FFFD per byte, even its valid bytes, so invalid UTF-8 can rewrite text already sent
    # (as in vLLM). Valid text is covered by the test above.
    vocab = SENTENCEPIECE.get_vocab()
    words = sorted(i for t, i in vocab.items() if not t.startswith("<0x"))
    ids = data.draw(st.lists(st.sampled_from(words), max_size=24))
    want = SENTENCEPIECE.decode(ids, skip_special_tokens=skip)
    assert run(WindowStream(SENTENCEPIECE, skip), ids)[1] == want


def test_window_stream_cannot_grow_without_bound() -> None:
    # Special tokens decode to nothing when skipped: the window is emitted anyway.
    stream = WindowStream(SENTENCEPIECE, True)
    for _ in range(100):
        stream.push(2)
    assert len(stream._ids) <= 2 * MAX_PENDING_TOKENS


@pytest.mark.parametrize("num_special", [1, 13, 14, 15, 40])
def test_skipped_tokens_inside_a_character_do_not_break_it(num_special: int) -> None:
    """A character's byte-fallback tokens around many skipped special tokens: the window
    was emitted after 16 tokens without text, with the character still incomplete."""
    vocab = SENTENCEPIECE.get_vocab()
    hello = SENTENCEPIECE.encode("hello").ids
    ids = [*hello, vocab["<0xE4>"], *[vocab["<s>"]] * num_special, vocab["<0xB8>"], vocab["<0xAD>"]]
    special = Detokenizer(SENTENCEPIECE).special_ids
    pieces, full = run(WindowStream(SENTENCEPIECE, True, special), ids)
    assert full == SENTENCEPIECE.decode(ids, skip_special_tokens=True) == "hello中"
    assert "\ufffd" not in "".join(pieces)


def test_a_missing_tokenizer_names_its_path(tmp_path) -> None:
    for path in (tmp_path / "absent", tmp_path):  # no such path; a directory without one
        with pytest.raises(FileNotFoundError, match=str(path)):
            Detokenizer.from_path(str(path))


@settings(max_examples=150, deadline=None)
@given(text=unicode_text, data=st.data())
def test_outputs_read_as_they_follow_the_prompt(text: str, data: st.DataObject) -> None:
    """A stream started from the prompt's last tokens emits the text the outputs add after
    it: a SentencePiece-style decoder strips the leading space of a text, so an output's
    first word lost its space ("Hello" + "▁word" read "Helloword", not "Hello word")."""
    ids = SENTENCEPIECE.encode(text).ids
    split = data.draw(st.integers(0, len(ids)))
    prompt, outputs = ids[:split], ids[split:]
    whole, before = SENTENCEPIECE.decode(ids), SENTENCEPIECE.decode(prompt)
    stream = WindowStream(SENTENCEPIECE, True, context=prompt[-PROMPT_TAIL_TOKENS:])
    pieces, full = run(stream, outputs)
    if whole.startswith(before):  # (else the prompt ends inside a character)
        assert full == whole[len(before) :]
        assert "\ufffd" not in "".join(pieces)


def test_a_prompt_tail_that_starts_inside_a_character() -> None:
    """The prompt's last 5 tokens begin with the last byte of one character: decoded as a
    group, every byte of it read U+FFFD, the whole tail was dropped and the output's
    space with it (the decoder strips a text's leading space)."""
    ids = SENTENCEPIECE.encode("\x80\U00010000 ").ids  # ..., <0x80>, 4 bytes, "▁"
    prompt, outputs = ids[:-1], ids[-1:]
    stream = WindowStream(SENTENCEPIECE, True, context=prompt[-PROMPT_TAIL_TOKENS:])
    assert run(stream, outputs)[1] == " "


def test_the_first_output_word_keeps_its_space() -> None:
    prompt = SENTENCEPIECE.encode("Hello").ids
    word = SENTENCEPIECE.encode("the the").ids[-1]
    assert SENTENCEPIECE.id_to_token(word).startswith("▁")
    detok = Detokenizer(SENTENCEPIECE)
    assert run(detok.stream(True, prompt), [word, word])[1] == " the the"
    assert run(detok.stream(True), [word, word])[1] == "the the"  # no context: decode(ids)
    # A prompt that ends inside a character: its bytes are left out of the context.
    partial = [*prompt, SENTENCEPIECE.token_to_id("<0xE4>")]
    assert run(detok.stream(True, partial), [word])[1] == " the"
