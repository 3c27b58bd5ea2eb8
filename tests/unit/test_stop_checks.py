"""Stop strings over streamed text: matches across pieces, truncation, and hold-back."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpengine.output.stop import StopStrings, TextState


def stream(stops: StopStrings, pieces: list[str]) -> tuple[list[str], str | None]:
    """Feed ``pieces``; return what was sent after each piece (the release at the end
    included when nothing matched) and the matched stop string."""
    state = TextState()
    sent = []
    for piece in pieces:
        text, stop = stops.scan(state, piece, search=True)
        sent.append(text)
        if stop is not None:
            return sent, stop
    sent.append(stops.release(state))
    return sent, None


def expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The reference: cut at the first place where any stop string is complete (the
    longest one ending there), before it or, with ``include``, after it."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def longest_held(text: str, stops: list[str]) -> int:
    lengths = [k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])]
    return max(lengths, default=0)


def test_match_across_pieces_is_cut_before_the_stop() -> None:
    sent, stop = stream(StopStrings(("STOP",)), ["Hello S", "T", "OP and more"])
    assert stop == "STOP"
    assert "".join(sent) == "Hello "
    assert sent == ["Hello ", "", ""]  # "S" and "T" were held back, never sent


def test_include_stop_str_in_output_cuts_after_the_stop() -> None:
    sent, stop = stream(StopStrings(("STOP",), include_in_output=True), ["ab ST", "OPcd"])
    assert stop == "STOP"
    assert "".join(sent) == "ab STOP"
    assert sent[0] == "ab ST"  # nothing is held back: the stop string is sent anyway


def test_held_text_is_sent_when_the_prefix_breaks() -> None:
    stops = StopStrings(("</answer>",))
    state = TextState()
    assert stops.scan(state, "x </ans", True) == ("x ", None)
    assert state.held == "</ans"
    assert stops.scan(state, "wer>", True) == ("", "</answer>")
    state = TextState()
    stops.scan(state, "x </ans", True)
    assert stops.scan(state, "i>", True) == ("</ansi>", None)
    assert state.held == ""


def test_only_a_prefix_of_a_stop_is_held() -> None:
    stops = StopStrings(("abc", "xyz"))
    state = TextState()
    assert stops.scan(state, "hello world", True) == ("hello world", None)
    assert stops.scan(state, " ab", True) == (" ", None)
    assert state.held == "ab"
    assert stops.release(state) == "ab"


def test_first_completed_match_wins_whatever_the_list_order() -> None:
    # "c" completes before "abcd" does, as it would have character by character.
    assert stream(StopStrings(("abcd", "c")), ["xabcd"]) == (["xab"], "c")
    assert stream(StopStrings(("abcd", "c")), ["xa", "b", "cd"]) == (["x", "", "ab"], "c")
    # Two stops ending at the same place: the longer one is cut.
    assert stream(StopStrings(("bc", "abc")), ["zzabc"]) == (["zz"], "abc")


def test_search_false_holds_back_but_never_stops() -> None:
    stops = StopStrings(("END",))
    state = TextState()
    assert stops.scan(state, "xEND", search=False) == ("xEND", None)
    assert stops.scan(state, "E", search=False) == ("", None)
    # A match must end in new text: the END seen during min_tokens does not count.
    assert stops.scan(state, "N", search=True) == ("", None)
    assert stops.scan(state, "D", search=True) == ("", "END")


def test_long_and_special_stop_strings() -> None:
    long_stop = "(.*)" * 60 + "\n"
    stops = StopStrings((long_stop, "?", "\\"))
    sent, stop = stream(stops, ["a(.*)", long_stop[4:], "tail"])
    assert (stop, "".join(sent)) == (long_stop, "a")
    sent, stop = stream(stops, ["a\\", "b"])
    assert (stop, "".join(sent)) == ("\\", "a")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStrings(("ok", ""))


alphabet = st.sampled_from("ab\n✓日")
texts = st.text(alphabet, max_size=30)


@settings(max_examples=400, deadline=None)
@given(
    text=texts,
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_streaming_equals_the_reference_for_any_split(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    checker = StopStrings(tuple(stops), include_in_output=include)
    state = TextState()
    sent = ""
    seen = ""
    want_text, want_stop = expected(text, stops, include)
    for piece in pieces:
        out, stop = checker.scan(state, piece, search=True)
        sent += out
        seen += piece
        # Never send anything the final output does not start with.
        assert want_text.startswith(sent)
        if stop is not None:
            assert (sent, stop) == (want_text, want_stop)
            return
        # Everything seen is sent or held, and exactly the longest stop prefix is held.
        assert sent + state.held == seen
        assert len(state.held) == (0 if include else longest_held(seen, stops))
    assert want_stop is None
    assert sent + checker.release(state) == text


def expected_after(
    text: str, stops: list[str], include: bool, quiet: int
) -> tuple[str, str | None]:
    """``expected`` when the first ``quiet`` characters came with ``search=False``
    (``min_tokens``): only a match that ends after them counts."""
    for end in range(quiet + 1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def split(text: str, rng: random.Random, longest: int) -> list[str]:
    pieces = []
    while text:
        size = rng.randint(1, longest)
        pieces.append(text[:size])
        text = text[size:]
    return pieces


def check_build_is_linear(stops: StopStrings) -> None:
    total = sum(map(len, stops.stops))
    assert stops.num_nodes <= total + 1
    # Inserting walks each stop string once; the failure-link walks along a stop string
    # take at most twice its length.
    assert stops.build_steps <= 3 * total


def test_hostile_stop_strings_build_linearly_and_stream_correctly() -> None:
    # Each of these made the regex implementation recurse too deep or compile for seconds.
    rng = random.Random(0)
    many = StopStrings(("x" * 4096, *(f"{i}" * 4096 for i in range(63))))
    check_build_is_linear(many)
    text = "y" + "0" * 4200
    sent, stop = stream(many, split(text, rng, 7))
    assert ("".join(sent), stop) == expected(text, list(many.stops), False)

    text = "a" * 5000 + "b"
    for stops in (("a" * 4095 + "b",), ("ab" * 2048,), ("a" * 4095 + "b", "ab" * 2048)):
        checker = StopStrings(stops)
        check_build_is_linear(checker)
        state = TextState()
        seen = sent_text = ""
        for piece in split(text, rng, 300):
            out, stop = checker.scan(state, piece, True)
            sent_text += out
            seen += piece
            if stop is not None:
                break
            # The held text is bounded by the longest stop, never the whole output.
            assert state.held == seen[len(seen) - longest_held(seen, list(stops)) :]
        if stop is None:
            sent_text += checker.release(state)
        assert (sent_text, stop) == expected(text, list(stops), False)

    text = "ab" * 3000
    checker = StopStrings(("ab" * 2048,))
    sent, stop = stream(checker, split(text, rng, 50))
    assert ("".join(sent), stop) == ("", "ab" * 2048)
    broken = "ab" * 1500 + "b" + "ab" * 2047 + "a"
    sent, stop = stream(checker, split(broken, rng, 50))
    assert ("".join(sent), stop) == (broken, None)


def test_a_piece_without_stop_characters_breaks_a_partial_match() -> None:
    # With include nothing is held, so only the automaton remembers the "ab".
    for include in (False, True):
        sent, stop = stream(StopStrings(("abc",), include), ["ab", "z", "c", "abc"])
        assert ("".join(sent), stop) == expected("abzcabc", ["abc"], include)


def test_two_thousand_long_stop_strings_build() -> None:
    rng = random.Random(1)
    stops = tuple(format(rng.getrandbits(450), "0450b") for _ in range(2000))
    checker = StopStrings(stops)
    check_build_is_linear(checker)
    # "x" is in no stop string, so the first match is the one streamed after it.
    sent, stop = stream(checker, split("xx" + stops[1234] + "01", rng, 9))
    assert ("".join(sent), stop) == ("xx", stops[1234])


@st.composite
def stop_cases(draw: st.DrawFn) -> tuple[str, list[str], list[str], int, bool]:
    letters = draw(st.lists(st.sampled_from("ab\n✓日"), min_size=2, max_size=3, unique=True))
    alphabet_ = st.sampled_from(letters)
    stops = draw(st.lists(st.text(alphabet_, min_size=1, max_size=8), min_size=1, max_size=6))
    text = draw(st.text(alphabet_, max_size=60))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=20))
    bounds = sorted({0, len(text), *cuts})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    quiet = draw(st.integers(0, len(pieces)))
    return text, stops, pieces, quiet, draw(st.booleans())


@settings(max_examples=600, deadline=None)
@given(case=stop_cases())
def test_small_alphabets_match_the_references(
    case: tuple[str, list[str], list[str], int, bool],
) -> None:
    """Few letters make stop strings overlap and share prefixes, exercising failure links;
    the first ``quiet`` pieces are scanned with ``search=False`` (``min_tokens``)."""
    text, stops, pieces, quiet, include = case
    quiet_len = sum(map(len, pieces[:quiet]))
    want = (
        expected(text, stops, include)
        if quiet_len == 0
        else expected_after(text, stops, include, quiet_len)
    )
    checker = StopStrings(tuple(stops), include_in_output=include)
    state = TextState()
    sent = seen = ""
    for number, piece in enumerate(pieces):
        out, stop = checker.scan(state, piece, search=number >= quiet)
        sent += out
        seen += piece
        assert want[0].startswith(sent)
        if stop is not None:
            assert (sent, stop) == want
            return
        assert sent + state.held == seen
        held = 0 if include else longest_held(seen, stops)
        assert state.held == seen[len(seen) - held :]
    assert want[1] is None
    assert sent + checker.release(state) == text
    assert state.held == ""
