"""Stop strings over streamed text: matching across token boundaries, and hold-back.

Text reaches a sequence a few characters at a time. A stop string may straddle any number
of pieces, so each sequence keeps a *window*: the last ``max_len - 1`` characters decoded
so far (any match that ends in new text starts inside the window or the new text). Only
``window + new`` is searched, never the whole output.

While streaming with ``include_stop_str_in_output=False`` the output is cut *before* the
stop string, so text that could be the beginning of one is *held back* until it is either
completed (and dropped) or ruled out (and sent). Only the longest suffix that is a proper
prefix of some stop string is held, not a fixed ``max_len - 1`` characters as vLLM does,
so ordinary text streams without delay. With ``include_stop_str_in_output=True`` the cut is
at the end of the stop string, after anything already sent, so nothing is held.

Invariant (no include): the held text is a suffix of the window, and every future match
starts inside the held text or later, so a delta never carries part of a stop string that
later completes.

The stop that ends the text is the one that completes first, as if the text arrived one
character at a time, so the result does not depend on how the text was split into tokens.
Per piece the cost is a ``str.find`` per stop string and one regex search over the last
``max_len - 1`` characters; a piece with no character of any stop string costs one set
check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(slots=True)
class TextState:
    """A sequence's streaming text state (see the module docstring)."""

    window: str = ""  # the last max_len - 1 characters decoded (held included)
    held: str = ""  # decoded but not sent: could be the start of a stop string


def _prefix_pattern(stop: str) -> str:
    """A regex matching any non-empty proper prefix of ``stop``: ``a(?:b(?:c)?)?`` for
    ``abcd`` (nested, so matching is linear in the stop's length)."""
    pattern = ""
    for char in reversed(stop[:-1]):
        pattern = re.escape(char) + (f"(?:{pattern})?" if pattern else "")
    return pattern


class StopStrings:
    """One request's stop strings and how to cut the text when one matches."""

    __slots__ = ("_chars", "_holdback", "_searches", "_window_len", "include_in_output", "stops")

    def __init__(self, stops: tuple[str, ...], include_in_output: bool = False) -> None:
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self.include_in_output = include_in_output
        self._window_len = max((len(s) for s in stops), default=1) - 1
        self._chars = frozenset("".join(stops))
        # (stop, how far before the new text a match of it can start)
        self._searches = [(stop, len(stop) - 1) for stop in stops]
        prefixes = [_prefix_pattern(s) for s in stops if len(s) > 1]
        # Leftmost match = longest suffix of the text that is a proper prefix of a stop.
        self._holdback = (
            re.compile(f"(?:{'|'.join(prefixes)})\\Z", re.DOTALL)
            if prefixes and not include_in_output
            else None
        )

    def find(self, text: str, new_start: int) -> tuple[str, int] | None:
        """The stop string that completes first in ``text`` after ``new_start``.

        Returns ``(stop, start_index)``. "First" is by where the match ends, as if the text
        arrived one character at a time, so the result does not depend on how the text was
        split into tokens; of two matches ending at the same place, the longer wins. (vLLM
        takes the first stop in list order that occurs in the new text.)
        """
        best_end = -1
        best: tuple[str, int] | None = None
        for stop, back in self._searches:
            index = text.find(stop, new_start - back if new_start > back else 0)
            if index != -1:
                end = index + back
                if best is None or end < best_end or (end == best_end and index < best[1]):
                    best_end, best = end, (stop, index)
        return best

    def holdback(self, text: str, start: int = 0) -> int:
        """Length of the longest suffix of ``text[start:]`` that is a proper prefix of a
        stop string (what must be held back)."""
        if self._holdback is None:
            return 0
        match = self._holdback.search(text, max(start, len(text) - self._window_len))
        return 0 if match is None else len(text) - match.start()

    def scan(self, state: TextState, new_text: str, search: bool) -> tuple[str, str | None]:
        """Add ``new_text``; return ``(text to send now, matched stop string or None)``.

        With ``search=False`` (still inside ``min_tokens``) no match is reported, but text
        is still held back. After a match the state is spent: the sequence is finished.
        """
        if not state.held and self._chars.isdisjoint(new_text):
            # No stop string can end in, start in or run through this text.
            state.window = ""
            return new_text, None
        window = state.window
        buf = window + new_text
        emit_from = len(window) - len(state.held)
        if search:
            hit = self.find(buf, len(window))
            if hit is not None:
                stop, index = hit
                end = index + len(stop) if self.include_in_output else index
                state.window = state.held = ""
                return buf[emit_from : max(end, emit_from)], stop
        # A held suffix starts inside the old held text or later (see the invariant).
        cut = len(buf) - self.holdback(buf, emit_from)
        state.held = buf[cut:]
        keep = self._window_len
        state.window = buf[len(buf) - keep :] if len(buf) > keep else buf
        return buf[emit_from:cut], None

    def release(self, state: TextState) -> str:
        """The sequence ended for another reason: the held text is final after all."""
        held = state.held
        state.window = state.held = ""
        return held
