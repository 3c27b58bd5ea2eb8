"""Incremental detokenization: token ids in, text out, one token at a time.

The contract of a stream (:class:`ByteStream` or :class:`WindowStream`): the concatenation
of everything ``push`` returned followed by ``flush()`` is the text the ids pushed add after
the stream's context (the prompt's last tokens), ``decode(context + ids)`` less
``decode(context)`` (``tokenizer.decode(..., skip_special_tokens=...)``); and ``push``
never returns the replacement character U+FFFD for a character whose bytes may still
arrive (byte-level BPE splits CJK and emoji across tokens). Byte-level decoding does not
depend on context: there it is ``decode(ids)``. A SentencePiece-style decoder strips the
leading space of a text: without the context, an output's first word would lose its space
("Hello" + "▁word" must read "Hello word"), as vLLM primes its detokenizer with the prompt.

Two ways to get there:

* Byte-level tokenizers (GPT-2, Qwen, Llama 3: the ``ByteLevel`` decoder) decode to
  ``utf8_lossy(concatenated token bytes)``. We precompute each token's bytes once and feed
  them to Python's UTF-8 decoder, which leaves an incomplete character undecoded and
  replaces invalid bytes exactly as ``String::from_utf8_lossy`` does. Most tokens are
  whole characters, and then a push is one list lookup: the fast path.
* Any other decoder (SentencePiece-style ``Metaspace`` + ``ByteFallback``, WordPiece) may
  depend on context, so we use the prefix/read-offset window vLLM uses: decode the last few
  tokens together and emit what grew beyond the decoded prefix, unless it ends in U+FFFD.
  Exact for valid UTF-8. On invalid bytes ``ByteFallback`` is not monotonic (it decodes a
  failed byte group to one U+FFFD per byte, valid ASCII bytes included), so text already
  sent can differ from a full decode in its replacement characters, as in vLLM.

``tokenizers.decoders.DecodeStream`` implements the second algorithm in Rust, but it cannot
flush the bytes it still holds when a sequence ends, and it raises on prefixes that
change under context ("Invalid prefix encountered"), so we keep the state ourselves.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer, decoders, pre_tokenizers

REPLACEMENT = "\ufffd"

# A window that has not produced text for this many tokens is emitted anyway: no UTF-8
# character needs more than four byte tokens, so only tokens that decode to nothing can
# keep a window open this long, and an ever-growing window would make decoding quadratic.
MAX_PENDING_TOKENS = 16


@dataclass
class ByteTable:
    """Per token id: its bytes, and its text when those bytes are whole characters."""

    bytes: list[bytes]
    texts: list[str | None] = field(default_factory=list)


class DetokenizerStream(Protocol):
    """Per-sequence incremental decoding state."""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        ...

    def flush(self) -> str:
        """The sequence ended: return whatever text is still held back."""
        ...


class ByteStream:
    """Incremental decoding for byte-level tokenizers: token bytes into a UTF-8 decoder.

    ``_pending`` holds the bytes of a character still incomplete. Most tokens are whole
    characters on their own, and with nothing pending their text is precomputed.
    """

    __slots__ = ("_bytes", "_pending", "_texts")

    def __init__(self, table: ByteTable) -> None:
        self._bytes = table.bytes
        self._texts = table.texts
        self._pending = b""

    def push(self, token_id: int) -> str:
        if not self._pending:
            try:
                text = self._texts[token_id]
            except IndexError:  # a padded model vocabulary: the tokenizer decodes nothing
                return ""
            if text is not None:
                return text
            data = self._bytes[token_id]
        else:
            try:
                data = self._pending + self._bytes[token_id]
            except IndexError:
                return ""
        # "replace" substitutes invalid bytes as String::from_utf8_lossy does; with
        # final=False an incomplete character at the end stays undecoded.
        text, consumed = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[consumed:]
        return text

    def flush(self) -> str:
        text = codecs.utf_8_decode(self._pending, "replace", True)[0]
        self._pending = b""
        return text


class WindowStream:
    """Incremental decoding for any tokenizer (vLLM's prefix/read-offset algorithm).

    ``_ids`` holds the tokens from the prefix offset on; the first ``_read`` of them were
    already emitted and decode to ``_prefix``. Each push decodes the window and emits the
    text beyond ``_prefix``, unless it ends in U+FFFD (a character still incomplete).
    Decoding a little context before the new tokens lets context-sensitive decoders
    (Metaspace's leading space, WordPiece's ``##``) treat the new tokens as mid-sequence;
    the first window starts with ``context`` (the prompt's last tokens), less a character
    it leaves incomplete (whose bytes would make its decoded length shrink).
    """

    __slots__ = ("_dropped", "_ids", "_prefix", "_read", "_skip", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool,
        special_ids: frozenset[int] = frozenset(),
        context: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Skipped tokens decode to nothing wherever they are: kept out of the window, they
        # cannot hold it open until it is emitted with a character still incomplete.
        self._dropped = special_ids if skip_special_tokens else frozenset()
        ids = [t for t in context if t not in self._dropped]
        prefix = self._decode(ids)
        # The tail may start inside a character (a byte-fallback group that does not decode
        # then reads as U+FFFD for every byte, whole characters after it included): drop
        # its first bytes (a character has at most 4), then any character left incomplete.
        for _ in range(3):
            if not prefix.startswith(REPLACEMENT):
                break
            del ids[0]
            prefix = self._decode(ids)
        while ids and prefix.endswith(REPLACEMENT):
            ids.pop()
            prefix = self._decode(ids)
        self._ids: list[int] = ids
        self._read = len(ids)
        self._prefix = prefix

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        if token_id in self._dropped:
            return ""
        ids = self._ids
        ids.append(token_id)
        text = self._tokenizer.decode(ids, skip_special_tokens=self._skip)
        if len(ids) - self._read < MAX_PENDING_TOKENS and (
            len(text) <= len(self._prefix) or text.endswith(REPLACEMENT)
        ):
            return ""
        new_text = text[len(self._prefix) :]
        del ids[: self._read]
        self._read = len(ids)
        self._prefix = self._tokenizer.decode(ids, skip_special_tokens=self._skip)
        return new_text

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        new_text = text[len(self._prefix) :]
        del self._ids[: len(self._ids)]
        self._read = 0
        self._prefix = ""
        return new_text


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level alphabet: display character -> byte value."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # The alphabet is GPT-2's bytes_to_unicode image; rebuild the mapping in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    mapping = {c: b for b, c in chars.items()}
    if set(mapping) != set(alphabet):
        raise RuntimeError("unexpected byte-level alphabet in the tokenizers library")
    return mapping


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes | None:
    """The bytes one token stands for when they are not whole characters: a byte-level
    BPE token mapped back through its alphabet, or a SentencePiece byte-fallback token
    (``<0xE4>``); None for any other token (its decoded text says it all)."""
    token = tokenizer.id_to_token(token_id)
    if token is None:
        return None
    match = _BYTE_FALLBACK.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    if isinstance(tokenizer.decoder, decoders.ByteLevel):
        byte_of = _byte_decoder()
        if all(c in byte_of for c in token):
            return bytes(byte_of[c] for c in token)
    return None


class Detokenizer:
    """One model's tokenizer: full decoding, and fresh incremental streams per sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self.special_ids = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        self._tables: dict[bool, ByteTable] = {}

    @classmethod
    def from_path(cls, path: str) -> Detokenizer:
        """Load ``tokenizer.json`` from a model directory, or the file itself."""
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer at {path!r} (a tokenizer.json or its directory)")
        return cls(Tokenizer.from_file(file))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def stream(
        self, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> DetokenizerStream:
        """A new incremental decoder for one sequence, whose text follows ``context`` (the
        prompt's last tokens)."""
        if self.byte_level:
            return ByteStream(self._table(skip_special_tokens))
        return WindowStream(self.tokenizer, skip_special_tokens, self.special_ids, context)

    def _table(self, skip_special_tokens: bool) -> ByteTable:
        """Each token id's bytes, as the ``ByteLevel`` decoder produces them.

        Built on first use (~0.1 s for a 150k vocabulary). A token is mapped through the
        byte alphabet; one with a character outside it (only added tokens can have one) is
        taken as its UTF-8 bytes, as the decoder does. Ids the tokenizer does not know
        decode to nothing, like skipped special tokens.
        """
        table = self._tables.get(skip_special_tokens)
        if table is not None:
            return table
        byte_of = _byte_decoder()
        alphabet = frozenset(byte_of)
        to_latin1 = str.maketrans({c: chr(b) for c, b in byte_of.items()})
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        table = ByteTable([b""] * (max(vocab.values(), default=-1) + 1))
        for token, token_id in vocab.items():
            if skip_special_tokens and token_id in self.special_ids:
                continue
            if alphabet.issuperset(token):
                table.bytes[token_id] = token.translate(to_latin1).encode("latin-1")
            else:
                table.bytes[token_id] = token.encode("utf-8")
        table.texts = [_whole_text(data) for data in table.bytes]
        self._tables[skip_special_tokens] = table
        return table


def _whole_text(data: bytes) -> str | None:
    """The text of bytes that decode on their own (valid UTF-8 from a character boundary
    to one), else None."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
