"""Stop strings over streamed text: matches across pieces, truncation, and hold-back."""

from __future__ import annotations

import itertools

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
