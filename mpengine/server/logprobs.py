"""Logprobs in OpenAI's two formats.

The engine gives, per token, ``{token id: logprob}`` holding the top N and the chosen
token. Completions list the tokens' texts, their logprobs, each position's alternatives
(all the engine returned) and each token's offset in the text; chat lists, per token, its
text, logprob and UTF-8 bytes, with exactly the N most likely alternatives.
"""

from __future__ import annotations

from mpengine.server.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from mpengine.server.text import TextTools


def completion_logprobs(
    text: TextTools,
    token_ids: list[int],
    rows: list[dict[int, float]] | list[dict[int, float] | None],
    offset: int,
) -> tuple[CompletionLogprobs, int]:
    """The completions format for ``token_ids`` starting at character ``offset`` of the
    choice's text; also returns the offset after them. A ``None`` row (a prompt's first
    token) has no logprob."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, row in zip(token_ids, rows, strict=True):
        token = text.token_text(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if row is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(row.get(token_id))
            tops.append({text.token_text(t): v for t, v in row.items()})
    return CompletionLogprobs(offsets, values, tokens, tops), offset


def chat_logprobs(
    text: TextTools, token_ids: list[int], rows: list[dict[int, float]], num_top: int
) -> ChatLogprobs:
    content = []
    for token_id, row in zip(token_ids, rows, strict=True):
        best = sorted(row.items(), key=lambda item: -item[1])[:num_top]
        top = [_top(text, t, v) for t, v in best]
        token = text.token_text(token_id)
        content.append(TokenLogprob(token, row[token_id], list(token.encode()), top))
    return ChatLogprobs(content)


def _top(text: TextTools, token_id: int, value: float) -> TopLogprob:
    token = text.token_text(token_id)
    return TopLogprob(token, value, list(token.encode()))
