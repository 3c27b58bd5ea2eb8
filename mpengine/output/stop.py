"""Stop strings over streamed text: matching across token boundaries, and hold-back.

Text reaches a sequence a few characters at a time, and a stop string may straddle any number
of pieces. All stop strings of a request are compiled into one Aho-Corasick automaton: a trie
of the stop strings whose node for a string ``p`` has a *failure link* to the node of the
longest proper suffix of ``p`` that is also in the trie. A sequence's state is one node: the
longest suffix of the text seen so far that is a prefix of some stop string. Each character
moves it along a trie edge, following failure links first while none fits. Every node also
knows the longest stop string that is a suffix of it (the match ending at that character) and
the longest suffix of it that is a *proper* prefix of a stop string (what to hold back).

While streaming with ``include_stop_str_in_output=False`` the output is cut *before* the stop
string, so text that could be the beginning of one is held back until it is either completed
(and dropped) or ruled out (and sent). Only the longest suffix that is a proper prefix of some
stop string is held, not a fixed ``max_len - 1`` characters as vLLM does, so ordinary text
streams without delay. With ``include_stop_str_in_output=True`` the cut is at the end of the
stop string, after anything already sent, so nothing is held.

Invariant (no include): the held text is exactly the longest suffix of the text seen that is
a proper prefix of a stop string. Any later match starts inside it or later (the part of the
match before the new text is such a suffix), so a delta never carries part of a stop string
that later completes, and the cut never falls before the held text.

The stop that ends the text is the one that completes first, as if the text arrived one
character at a time (the automaton does exactly that), so the result does not depend on how
the text was split into tokens; of two ending at the same character the longer wins.

Costs, safe against hostile stop strings (nothing is recursive, nothing is compiled):
set-up builds the trie and then the failure links breadth-first, O(total length of the stop
strings) steps and a few machine words per trie node. A piece costs O(len(piece)) automaton
steps amortised over the stream, at most O(longest stop) more for the depth carried in, plus
copying the held text (shorter than the longest stop). A piece with no character of any stop
string while nothing is held costs one set check. A sequence keeps an int and the held text.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

# A trie edge ``node --char--> child`` that is not a chain edge is keyed ``node << _SHIFT |
# ord(char)``: code points are below 0x110000 < 2**21.
_SHIFT = 21


@dataclass(slots=True)
class TextState:
    """A sequence's streaming text state (see the module docstring)."""

    node: int = 0  # automaton node: the longest suffix seen that is a prefix of a stop
    held: str = ""  # decoded but not sent: could be the start of a stop string


class _Trie:
    """The automaton of :class:`StopStrings` while it is built: the trie of the stop strings,
    then its failure links. ``parent``, ``incode`` and ``depth`` are needed only here."""

    def __init__(self) -> None:
        # Per node, indexed by node number (a few machine words each, no object per node):
        self.chain = array("i", [-1])  # code point of the chain edge node -> node + 1, or -1
        self.match = array("i", [-1])  # index of the longest stop string ending here, or -1
        self.hold = array("i", [0])  # length of the longest suffix that is a proper stop prefix
        self.parent = array("i", [0])
        self.incode = array("i", [-1])  # code point of the edge from the parent
        self.depth = array("i", [0])
        self.branch: dict[int, int] = {}
        self.steps = 0  # automaton steps taken

    def insert(self, index: int, stop: str) -> None:
        """Add stop string number ``index``."""
        node = pos = 0
        size = len(stop)
        while pos < size:  # walk the part of the stop already in the trie
            code = ord(stop[pos])
            if self.chain[node] == code:
                node += 1
            else:
                child = self.branch.get(node << _SHIFT | code)
                if child is None:
                    break
                node = child
            pos += 1
        self.steps += pos
        if pos < size:  # the rest becomes consecutive new nodes: bulk array operations
            new = len(self.chain)
            added = size - pos
            if node == new - 1:  # the newest node has no child yet: extend its chain
                self.chain[node] = ord(stop[pos])
            else:
                self.branch[node << _SHIFT | ord(stop[pos])] = new
            top = self.depth[node]
            self.hold[node] = top  # it has a child now; so do all new nodes but the last
            self.chain.extend(map(ord, stop[pos + 1 :]))
            self.chain.append(-1)
            self.incode.extend(map(ord, stop[pos:]))
            self.parent.append(node)
            self.parent.extend(range(new, new + added - 1))
            self.depth.extend(range(top + 1, top + added + 1))
            self.hold.extend(range(top + 1, top + added))
            self.hold.append(-1)  # a leaf: from its failure target, below
            self.match.extend(array("i", [-1]) * added)
            node = new + added - 1
            self.steps += added
        if self.match[node] < 0:  # its own string: the longest stop that can end here
            self.match[node] = index

    def link_failures(self) -> array:
        """Each node's failure link (and its inherited match and hold); returns the links."""
        chain, branch, match, hold = self.chain, self.branch, self.match, self.hold
        parent, incode, depth = self.parent, self.incode, self.depth
        steps = 0
        count = len(chain)
        fail = array("i", bytes(4 * count))  # the root and its children fail to the root
        # By depth, so a node's failure target and every node on the failure path walked to
        # find it (all shallower) are done before it. The walk is amortised: along each stop
        # string a failure link is at most one deeper than its parent's and each step down the
        # failure path makes it shallower, so the walks for one stop string take at most twice
        # its length in steps (``build_steps`` counts them). Sorting is cheap: each stop
        # string's new nodes are an ascending run of depths.
        for child in sorted(range(1, count), key=depth.__getitem__):
            target = 0
            up = parent[child]
            if up:
                code = incode[child]
                node = fail[up]
                while True:
                    steps += 1
                    if chain[node] == code:
                        target = node + 1
                        break
                    found = branch.get(node << _SHIFT | code)
                    if found is not None:
                        target = found
                        break
                    if not node:
                        break
                    node = fail[node]
                fail[child] = target
            # Otherwise the longest stop ending here, or suffix held, is its failure
            # target's (the longest proper suffix of it in the trie).
            if match[child] < 0:
                match[child] = match[target]
            if hold[child] < 0:
                hold[child] = hold[target]
        self.steps += steps
        return fail


class StopStrings:
    """One request's stop strings and how to cut the text when one matches.

    Trie nodes are numbered as they are created, so the characters a stop string adds to the
    trie become consecutive nodes: ``node -> node + 1`` is a *chain* edge stored as one code
    point per node in ``_chain`` (-1: none). The few other edges, where stop strings branch,
    live in the dict ``_branch``. That keeps a node at a few machine words (no dict per node)
    however long or many the stop strings are. ``num_nodes`` and ``build_steps`` (automaton
    steps taken to build it) show that set-up is linear in the total length of the stops.
    """

    __slots__ = (
        "_branch",
        "_chain",
        "_chars",
        "_fail",
        "_hold",
        "_match",
        "build_steps",
        "include_in_output",
        "num_nodes",
        "stops",
    )

    def __init__(self, stops: tuple[str, ...], include_in_output: bool = False) -> None:
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self.include_in_output = include_in_output
        self._chars = frozenset("".join(stops))
        trie = _Trie()
        for index, stop in enumerate(stops):
            trie.insert(index, stop)
        self._fail = trie.link_failures()
        self._chain = trie.chain
        self._branch = trie.branch
        self._match = trie.match
        self._hold = trie.hold
        self.num_nodes = len(trie.chain)
        self.build_steps = trie.steps

    def scan(self, state: TextState, new_text: str, search: bool) -> tuple[str, str | None]:
        """Add ``new_text``; return ``(text to send now, matched stop string or None)``.

        With ``search=False`` (still inside ``min_tokens``) no match is reported, but text
        is still held back. After a match the state is spent: the sequence is finished.
        """
        held = state.held
        if not held and self._chars.isdisjoint(new_text):
            # No stop string can end in, start in or run through this text, and a character
            # of none of them sends the automaton back to the root.
            state.node = 0
            return new_text, None
        chain = self._chain
        branch = self._branch
        fail = self._fail
        match = self._match
        node = state.node
        for index, code in enumerate(map(ord, new_text)):
            # Follow failure links until an edge fits (or the root has none for this char).
            while chain[node] != code:
                found = branch.get(node << _SHIFT | code)
                if found is not None:
                    node = found
                    break
                if not node:
                    break
                node = fail[node]
            else:
                node += 1
            if search and match[node] >= 0:
                stop = self.stops[match[node]]
                state.node = 0
                state.held = ""
                end = index + 1
                if self.include_in_output:
                    return new_text[:end], stop  # nothing is held with include
                # The match starts inside the held text or later (invariant), so cut >= 0.
                cut = len(held) + end - len(stop)
                if cut <= len(held):
                    return held[:cut], stop
                return held + new_text[: cut - len(held)], stop
        state.node = node
        keep = 0 if self.include_in_output else self._hold[node]
        # keep <= len(held) + len(new_text): see the invariant.
        if keep == 0:
            state.held = ""
            return held + new_text, None
        cut = len(held) + len(new_text) - keep
        if cut >= len(held):
            cut -= len(held)
            state.held = new_text[cut:]
            return held + new_text[:cut], None
        state.held = held[cut:] + new_text
        return held[:cut], None

    def release(self, state: TextState) -> str:
        """The sequence ended for another reason: the held text is final after all."""
        held = state.held
        state.node = 0
        state.held = ""
        return held
