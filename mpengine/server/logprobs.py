"""Logprobs in OpenAI's two formats.

The engine gives, per token, ``{token id: logprob}`` holding the top N and the chosen
token. Completions list the tokens' texts, their logprobs, each position's alternatives
(all the engine returned) and each token's offset in the text; chat lists, per token, its
text, logprob and UTF-8 bytes (a token that is part of a character reads as U+FFFD, as in
OpenAI's and vLLM's outputs, and its bytes are its own), with exactly the N most likely
alternatives. With vLLM's
``return_tokens_as_token_ids``, tokens are named ``token_id:ID`` (bytes and offsets stay
those of their text).
"""

from __future__ import annotations

from mpengine.server.schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
)
from mpengine.server.text import TextTools


def completion_logprobs(
    text: TextTools,
    token_ids: list[int],
    rows: list[dict[int, float]] | list[dict[int, float] | None],
    offset: int,
    as_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """The completions format for ``token_ids`` starting at character ``offset`` of the
    choice's text; also returns the offset after them. A ``None`` row (a prompt's first
    token) has no logprob."""
    name = _id_name if as_ids else text.token_text
    tokens, values, tops, offsets = [], [], [], []
    for token_id, row in zip(token_ids, rows, strict=True):
        tokens.append(name(token_id))
        offsets.append(offset)
        offset += len(text.token_text(token_id))
        if row is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(row.get(token_id))
            tops.append({name(t): v for t, v in row.items()})
    return CompletionLogprobs(offsets, values, tokens, tops), offset


def _id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def prompt_logprob_entries(
    text: TextTools,
    token_ids: list[int],
    rows: list[dict[int, float] | None],
    num_top: int,
    ranks: list[int | None] | None = None,
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token, it and the top
    ``num_top`` with their logprob, rank (1 = most likely) and text. A row holds at least
    the top ``num_top`` of the vocabulary, so their ranks are exact; the prompt token's
    comes from the engine (``ranks``), else it is null when outside the top."""
    out: list[dict[int, PromptLogprob] | None] = []
    ranks = ranks or [None] * len(token_ids)
    for token_id, row, known in zip(token_ids, rows, ranks, strict=True):
        if row is None:
            out.append(None)
            continue
        ranked = sorted(row.items(), key=lambda item: -item[1])
        entries = {}
        rank, previous = 0, None
        for index, (t, v) in enumerate(ranked):  # rank: 1 + how many are more likely
            if v != previous:
                rank, previous = index + 1, v
            if index < num_top:
                entries[t] = PromptLogprob(v, rank, text.token_text(t))
            elif num_top and t == token_id and known is None and v == ranked[num_top - 1][1]:
                known = rank  # a tie with the last of the top
        if token_id not in entries:
            value = row[token_id]
            entries[token_id] = PromptLogprob(value, known, text.token_text(token_id))
        out.append(entries)
    return out


def chat_logprobs(
    text: TextTools,
    token_ids: list[int],
    rows: list[dict[int, float]],
    num_top: int,
    as_ids: bool = False,
) -> ChatLogprobs:
    content = []
    for token_id, row in zip(token_ids, rows, strict=True):
        best = sorted(row.items(), key=lambda item: -item[1])[:num_top]
        top = [_top(text, t, v, as_ids) for t, v in best]
        token = text.token_text(token_id)
        name = _id_name(token_id) if as_ids else token
        content.append(TokenLogprob(name, row[token_id], list(text.token_bytes(token_id)), top))
    return ChatLogprobs(content)


def _top(text: TextTools, token_id: int, value: float, as_ids: bool) -> TopLogprob:
    name = _id_name(token_id) if as_ids else text.token_text(token_id)
    return TopLogprob(name, value, list(text.token_bytes(token_id)))
